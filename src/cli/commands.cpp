#include "cli/commands.h"

#include <CLI/CLI.hpp>
#include <cstdio>

namespace bb::cli {

int run(int argc, char** argv) {
  CLI::App app{"bumblebee: long-sequence MoE training on few GPUs"};
  app.require_subcommand(1);
  auto* version = app.add_subcommand("version", "Print the version");
  version->callback([] { std::printf("bumblebee 0.1.0\n"); });
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return 0;
}

}  // namespace bb::cli
