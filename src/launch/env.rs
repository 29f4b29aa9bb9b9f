//! Who this process is in a multi-process job: [`RankEnv::detect`] reads the launcher's
//! environment variables.
//!
//! Launchers are tried in a fixed order and the first that sets a rank wins: pipefill's own
//! (`PIPEFILL_RANK`, `PIPEFILL_WORLD_SIZE`, `PIPEFILL_LOCAL_RANK`, `PIPEFILL_MASTER_ADDR`,
//! `PIPEFILL_MASTER_PORT`, `PIPEFILL_TOKEN`), torchrun's (`RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`), OpenMPI's (`OMPI_COMM_WORLD_RANK`, `_SIZE`,
//! `_LOCAL_RANK`), PMI's (`PMI_RANK`, `PMI_SIZE`) and Slurm's (`SLURM_PROCID`,
//! `SLURM_NTASKS`, `SLURM_LOCALID`). With none of them the process is a single-process job.
//!
//! The master address and port fall back to pipefill's, then torchrun's variables, then
//! `127.0.0.1:29500` (MPI and Slurm do not set one; every rank computes the same default).
//! The job token is `PIPEFILL_TOKEN`; without it a multi-process job is refused, since
//! nothing could tell a peer from a stranger.

use std::collections::HashMap;

use crate::launch::LaunchError;

/// The default rendezvous port (torchrun's).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Which launcher's variables gave the rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    Pipefill,
    Torchrun,
    OpenMpi,
    Pmi,
    Slurm,
}

impl Launcher {
    /// (launcher, rank var, world var, local-rank var), in the order they are tried.
    const VARS: [(Launcher, &'static str, &'static str, Option<&'static str>); 5] = [
        (
            Launcher::Pipefill,
            "PIPEFILL_RANK",
            "PIPEFILL_WORLD_SIZE",
            Some("PIPEFILL_LOCAL_RANK"),
        ),
        (Launcher::Torchrun, "RANK", "WORLD_SIZE", Some("LOCAL_RANK")),
        (
            Launcher::OpenMpi,
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            Some("OMPI_COMM_WORLD_LOCAL_RANK"),
        ),
        (Launcher::Pmi, "PMI_RANK", "PMI_SIZE", None),
        (
            Launcher::Slurm,
            "SLURM_PROCID",
            "SLURM_NTASKS",
            Some("SLURM_LOCALID"),
        ),
    ];
}

/// This process's place in the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankEnv {
    pub rank: usize,
    pub world: usize,
    pub local_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    pub token: Option<String>,
    /// `None` for a single-process job (no launcher variables).
    pub launcher: Option<Launcher>,
}

impl RankEnv {
    /// The single-process job.
    pub fn single() -> Self {
        RankEnv {
            rank: 0,
            world: 1,
            local_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_MASTER_PORT,
            token: None,
            launcher: None,
        }
    }

    /// Reads this process's environment.
    pub fn detect() -> Result<Self, LaunchError> {
        Self::from_vars(&std::env::vars().collect())
    }

    /// Reads `vars` as if they were the environment.
    pub fn from_vars(vars: &HashMap<String, String>) -> Result<Self, LaunchError> {
        let get = |k: &str| vars.get(k).map(|v| v.trim()).filter(|v| !v.is_empty());
        let num = |var: &'static str, what| -> Result<Option<usize>, LaunchError> {
            get(var)
                .map(|v| {
                    v.parse().map_err(|_| LaunchError::Invalid {
                        var,
                        value: v.to_string(),
                        what,
                    })
                })
                .transpose()
        };
        let mut env = RankEnv::single();
        for (launcher, rank_var, world_var, local_var) in Launcher::VARS {
            let Some(rank) = num(rank_var, "rank (a non-negative integer)")? else {
                continue;
            };
            let world =
                num(world_var, "world size (a positive integer)")?.ok_or(LaunchError::NoWorld {
                    rank_var,
                    world_var,
                })?;
            if rank >= world {
                return Err(LaunchError::RankOutOfRange {
                    rank_var,
                    world_var,
                    rank,
                    world,
                });
            }
            env.rank = rank;
            env.world = world;
            env.local_rank = match local_var {
                Some(v) => num(v, "local rank (a non-negative integer)")?.unwrap_or(rank),
                None => rank,
            };
            env.launcher = Some(launcher);
            break;
        }
        if let Some(addr) = get("PIPEFILL_MASTER_ADDR").or_else(|| get("MASTER_ADDR")) {
            env.master_addr = addr.to_string();
        }
        for var in ["PIPEFILL_MASTER_PORT", "MASTER_PORT"] {
            if let Some(v) = get(var) {
                env.master_port = v.parse().map_err(|_| LaunchError::Invalid {
                    var,
                    value: v.to_string(),
                    what: "port (1-65535)",
                })?;
                break;
            }
        }
        env.token = get("PIPEFILL_TOKEN").map(str::to_string);
        Ok(env)
    }

    /// True when the job spans more than one process.
    pub fn is_distributed(&self) -> bool {
        self.world > 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(kv: &[(&str, &str)]) -> HashMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn no_variables_is_the_single_process_job() {
        let env = RankEnv::from_vars(&vars(&[("HOME", "/root")])).unwrap();
        assert_eq!(env, RankEnv::single());
        assert!(!env.is_distributed());
    }

    #[test]
    fn pipefill_variables_come_first() {
        let env = RankEnv::from_vars(&vars(&[
            ("PIPEFILL_RANK", "2"),
            ("PIPEFILL_WORLD_SIZE", "4"),
            ("PIPEFILL_LOCAL_RANK", "0"),
            ("PIPEFILL_MASTER_ADDR", "10.0.0.1"),
            ("PIPEFILL_MASTER_PORT", "1234"),
            ("PIPEFILL_TOKEN", "secret"),
            ("RANK", "1"),
            ("WORLD_SIZE", "8"),
            ("MASTER_PORT", "99"),
        ]))
        .unwrap();
        assert_eq!(
            (env.rank, env.world, env.local_rank, env.launcher),
            (2, 4, 0, Some(Launcher::Pipefill))
        );
        assert_eq!(
            (env.master_addr.as_str(), env.master_port),
            ("10.0.0.1", 1234)
        );
        assert_eq!(env.token.as_deref(), Some("secret"));
    }

    #[test]
    fn torchrun_variables() {
        let env = RankEnv::from_vars(&vars(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29400"),
        ]))
        .unwrap();
        assert_eq!(
            (env.rank, env.world, env.local_rank, env.launcher),
            (3, 4, 1, Some(Launcher::Torchrun))
        );
        assert_eq!(
            (env.master_addr.as_str(), env.master_port),
            ("node0", 29400)
        );
    }

    #[test]
    fn openmpi_variables_with_the_default_master() {
        let env = RankEnv::from_vars(&vars(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "2"),
        ]))
        .unwrap();
        assert_eq!(
            (env.rank, env.world, env.local_rank, env.launcher),
            (1, 2, 1, Some(Launcher::OpenMpi))
        );
        assert_eq!(
            (env.master_addr.as_str(), env.master_port),
            ("127.0.0.1", DEFAULT_MASTER_PORT)
        );
    }

    #[test]
    fn pmi_variables_use_the_rank_as_local_rank() {
        let env = RankEnv::from_vars(&vars(&[("PMI_RANK", "5"), ("PMI_SIZE", "6")])).unwrap();
        assert_eq!(
            (env.rank, env.world, env.local_rank, env.launcher),
            (5, 6, 5, Some(Launcher::Pmi))
        );
    }

    #[test]
    fn slurm_variables() {
        let env = RankEnv::from_vars(&vars(&[
            ("SLURM_PROCID", "7"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "3"),
        ]))
        .unwrap();
        assert_eq!(
            (env.rank, env.world, env.local_rank, env.launcher),
            (7, 8, 3, Some(Launcher::Slurm))
        );
    }

    #[test]
    fn bad_values_are_named() {
        assert!(matches!(
            RankEnv::from_vars(&vars(&[("RANK", "x"), ("WORLD_SIZE", "2")])).unwrap_err(),
            LaunchError::Invalid {
                var: "RANK",
                value,
                what: "rank (a non-negative integer)"
            } if value == "x"
        ));
        assert!(matches!(
            RankEnv::from_vars(&vars(&[("SLURM_PROCID", "0")])).unwrap_err(),
            LaunchError::NoWorld {
                rank_var: "SLURM_PROCID",
                world_var: "SLURM_NTASKS"
            }
        ));
        assert_eq!(
            RankEnv::from_vars(&vars(&[("PMI_RANK", "2"), ("PMI_SIZE", "2")]))
                .unwrap_err()
                .to_string(),
            "PMI_RANK=2 is not below PMI_SIZE=2"
        );
        assert!(
            RankEnv::from_vars(&vars(&[("MASTER_PORT", "70000")]))
                .unwrap_err()
                .to_string()
                .contains("MASTER_PORT")
        );
    }
}
