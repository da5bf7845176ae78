//! `commfuse completions <shell>`: the shell's completion script for every command and flag,
//! generated from the same clap definitions the parser uses, so it cannot fall behind them.

use anyhow::Result;
use clap::{Args, CommandFactory};
use clap_complete::Shell;

#[derive(Args, Debug)]
pub struct CompletionsArgs {
    /// The shell to complete for: bash, zsh, fish, elvish or powershell (e.g.
    /// `commfuse completions bash > ~/.local/share/bash-completion/completions/commfuse`)
    pub shell: Shell,
}

pub fn completions_cmd(args: CompletionsArgs) -> Result<i32> {
    let mut command = super::Cli::command();
    let name = command.get_name().to_string();
    clap_complete::generate(args.shell, &mut command, name, &mut std::io::stdout());
    Ok(0)
}
