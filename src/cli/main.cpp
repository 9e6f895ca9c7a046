// main.cpp — the `bumblebee` command.
#include <cstdio>
#include <exception>

#include "cli/commands.h"

int main(int argc, char** argv) {
  try {
    return bb::cli::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bumblebee: error: %s\n", e.what());
    return 2;
  }
}
