//! Command-line entry point of `converge-trainer`: parse the options, train, exit.

use clap::Parser;

fn main() {
    let args = converge_trainer::cli::Args::parse();
    std::process::exit(converge_trainer::train::main_with_args(args));
}
