//! Opening a backend by name.

use anyhow::{bail, Result};
use commfuse_core::backend::Backend;
use commfuse_sim::{SimBackend, WorldConfig};
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    Sim,
    Cuda,
}

impl FromStr for BackendKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "sim" => Ok(BackendKind::Sim),
            "cuda" => Ok(BackendKind::Cuda),
            _ => Err(format!("unknown backend '{s}' (choose sim or cuda)")),
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::Sim => "sim",
            BackendKind::Cuda => "cuda",
        })
    }
}

/// Where to run: a backend and its ranks.
#[derive(Debug, Clone)]
pub struct Placement {
    pub backend: BackendKind,
    pub ranks: usize,
    pub timeout: Duration,
}

pub fn open(placement: &Placement) -> Result<Box<dyn Backend>> {
    match placement.backend {
        BackendKind::Sim => {
            let config = WorldConfig {
                timeout: placement.timeout,
                ..WorldConfig::default()
            };
            Ok(Box::new(SimBackend::new(placement.ranks, config)?))
        }
        BackendKind::Cuda => {
            bail!("the cuda backend is not part of this build yet; use --backend sim")
        }
    }
}
