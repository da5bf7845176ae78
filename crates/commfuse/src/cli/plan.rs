//! `commfuse plan`: a plan's per-rank steps (or its JSON), the checker's verdict and the cost
//! card.

use super::common::{algo_label, What};
use crate::args::{elements, ranks};
use crate::driver;
use anyhow::{bail, Result};
use clap::Args;
use commfuse_core::cost::CostCard;
use commfuse_core::topology::LinkModel;
use commfuse_core::Implementation;

#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    pub what: What,
    /// Number of ranks
    #[arg(long, short = 'p', default_value_t = 4, allow_negative_numbers = true, value_parser = ranks())]
    pub ranks: usize,
    /// Element count
    #[arg(long, short = 'n', default_value_t = 1 << 20, allow_negative_numbers = true, value_parser = elements())]
    pub size: usize,
    /// Print the plan as JSON instead of a listing
    #[arg(long)]
    pub json: bool,
}

pub(super) fn plan(a: PlanArgs) -> Result<i32> {
    let (which, auto) = a.what.resolve(a.size, a.ranks, LinkModel::default())?;
    let algo = match which {
        Implementation::Plan(algo) => algo,
        Implementation::Protocol(p) => bail!(
            "{p} ({}) is a kernel of its own, with no plan of steps to list: `commfuse run {} --algo {p}` runs it",
            p.describe(),
            a.what.op
        ),
        Implementation::Baseline(b) => bail!(
            "{b} ({}) is a library call, with no plan of steps to list: `commfuse run {} --algo {b} --backend cuda` runs it",
            b.describe(),
            a.what.op
        ),
    };
    let req = a.what.request(algo, a.size, 0);
    if auto && !a.json {
        println!("algorithm: {}", algo_label(algo, auto));
    }
    let (checked, topology) = match driver::plan(&req, a.ranks) {
        Ok(x) => x,
        Err(commfuse_core::Error::Plan(e)) => {
            println!("checker: REJECTED: {e}");
            return Ok(1);
        }
        Err(e) => return Err(e.into()),
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(checked.plan())?);
        return Ok(0);
    }
    print!("{}", checked.plan().listing());
    println!("checker: OK (no deadlock, no reused slot, no race, result as defined; two consecutive calls)");
    println!("{}", CostCard::of(&checked, &topology, req.dtype.size()));
    Ok(0)
}
