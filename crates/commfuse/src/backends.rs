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
    /// GPUs, rank r on `devices[r]` (cuda only; default 0..ranks)
    pub devices: Option<Vec<usize>>,
    pub timeout: Duration,
}

impl Placement {
    pub fn sim(ranks: usize, timeout: Duration) -> Placement {
        Placement {
            backend: BackendKind::Sim,
            ranks,
            devices: None,
            timeout,
        }
    }

    /// The GPUs a cuda placement uses.
    pub fn device_list(&self) -> Vec<usize> {
        self.devices
            .clone()
            .unwrap_or_else(|| (0..self.ranks).collect())
    }
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
            let devices = placement.device_list();
            if devices.is_empty() {
                bail!("--devices names no GPU");
            }
            Ok(Box::new(commfuse_cuda::CudaBackend::open(
                &devices,
                placement.timeout,
            )?))
        }
    }
}
