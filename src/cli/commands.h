// commands.h — subcommands of the `bumblebee` program.
#pragma once

namespace bb::cli {
// Parses argv and runs the chosen subcommand; returns the process exit code.
int run(int argc, char** argv);
}  // namespace bb::cli
