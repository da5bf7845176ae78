//! The `commfuse` binary. Errors end in one line on stderr and a non-zero exit; a panic is a bug,
//! and even then the process prints one line instead of a backtrace.

use clap::Parser;
use commfuse::cli::{execute, Cli};

fn main() {
    // NVLink multicast can take a shared host's GPUs out of service: NCCL does not use it
    // unless the environment asks for it. Set before any thread exists.
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
    }
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        eprintln!("error: internal error{at}: {msg}");
    }));
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(
                e.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                let _ = e.print();
                std::process::exit(
                    if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                        2
                    } else {
                        0
                    },
                );
            }
            // clap's first paragraph, folded into one line (it names the offending argument)
            let text = e.to_string();
            let line: Vec<&str> = text
                .lines()
                .map(str::trim)
                .skip_while(|l| l.is_empty())
                .take_while(|l| !l.is_empty())
                .collect();
            eprintln!("{}", line.join(" "));
            std::process::exit(2);
        }
    };
    match execute(cli) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {}", format!("{e:#}").replace('\n', " "));
            std::process::exit(2);
        }
    }
}
