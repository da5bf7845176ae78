//! The command line as a user meets it: the main job works, and every bad input ends in one
//! line on stderr and a non-zero exit, never a panic or a hang.

use std::process::{Command, Output};

/// The binary under test: cargo's build of it, or `COMMFUSE_BIN` where the test binary runs on
/// a machine without the build tree (the GPU machine runs a copy of both).
fn binary() -> std::ffi::OsString {
    std::env::var_os("COMMFUSE_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_commfuse").into())
}

fn commfuse(args: &[&str]) -> Output {
    Command::new(binary())
        .args(args)
        .output()
        .expect("the binary runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Fails unless the command failed with exactly one line on stderr containing `needle`.
fn fails_with(args: &[&str], needle: &str) {
    let o = commfuse(args);
    let err = stderr(&o);
    assert_ne!(o.status.code(), Some(0), "{args:?} succeeded");
    assert!(o.status.code().is_some(), "{args:?} died from a signal");
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "{args:?} printed more than one line:\n{err}"
    );
    assert!(
        err.contains(needle),
        "{args:?}: expected '{needle}' in: {err}"
    );
    assert!(
        !err.contains("panicked") && !err.contains("internal error"),
        "{args:?} panicked: {err}"
    );
}

#[test]
fn run_checks_and_prints_ok() {
    let o = commfuse(&[
        "run",
        "all-reduce",
        "--algo",
        "ring",
        "--ranks",
        "5",
        "--size",
        "1003",
        "--dtype",
        "bf16",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("cost card: all-reduce ring on 5 ranks"),
        "{out}"
    );
    assert!(out.trim_end().ends_with("OK"), "{out}");
}

#[test]
fn bad_inputs_get_one_line_and_a_nonzero_exit() {
    fails_with(
        &["run", "all-reduce", "--ranks", "0"],
        "world size must be between 1 and 64, got 0",
    );
    fails_with(
        &["run", "all-reduce", "--ranks", "65"],
        "world size must be between 1 and 64, got 65",
    );
    fails_with(&["run", "all-reduse"], "unknown op 'all-reduse'");
    fails_with(
        &["kernels", "plan.cu", "gem.cu"],
        "no kernel file 'gem.cu' (the kernels: plan.cu, gemm.cu",
    );
    fails_with(
        &["run", "all-reduce", "--algo", "tree"],
        "all-reduce has no algorithm 'tree'",
    );
    fails_with(
        &["run", "barrier", "--algo", "one-shot"],
        "barrier has no algorithm 'one-shot'",
    );
    fails_with(
        &["run", "all-reduce", "--dtype", "f64"],
        "unknown dtype 'f64'",
    );
    fails_with(
        &["run", "all-reduce", "--reduce", "avg"],
        "unknown reduce op 'avg'",
    );
    fails_with(
        &["run", "all-reduce", "--size", "99999999999999999999999"],
        "--size",
    );
    fails_with(
        &["run", "all-reduce", "--size", "4611686018427387904"],
        "size overflow",
    );
    fails_with(
        &[
            "run",
            "all-reduce",
            "--size",
            "1152921504606846976",
            "--ranks",
            "2",
        ],
        "memory",
    );
    if commfuse_cuda::sys::driver::device_count().unwrap_or(0) == 0 {
        fails_with(
            &["run", "all-reduce", "--backend", "cuda"],
            "no CUDA driver",
        );
        fails_with(&["run", "all-reduce", "--devices", "0,1"], "no CUDA driver");
    } else {
        fails_with(
            &["run", "all-reduce", "--devices", "0,97"],
            "GPU 97 does not exist",
        );
    }
    fails_with(
        &["run", "all-reduce", "--backend", "tpu"],
        "unknown backend 'tpu'",
    );
    fails_with(
        &["run", "broadcast", "--ranks", "4", "--root", "4"],
        "root 4 is not a rank",
    );
    fails_with(
        &[
            "run",
            "all-reduce",
            "--algo",
            "ring-2d",
            "--ranks",
            "6",
            "--numa-groups",
            "4",
        ],
        "multiple of the NUMA group count",
    );
    fails_with(
        &["run", "all-reduce", "--numa-groups", "0"],
        "--numa-groups",
    );
    fails_with(&["bench", "all-reduce", "--sizes", "12Q"], "unknown unit");
    fails_with(&["bench", "all-reduce", "--sizes", "8K..1K"], "must go up");
    fails_with(&["verify", "--ranks", "0"], "at least 1");
    // the GEMM benches time GPUs only
    for op in ["gemm", "gemm-rs", "ag-gemm"] {
        fails_with(
            &[
                "bench",
                op,
                "--m",
                "64",
                "--n",
                "64",
                "--k",
                "64",
                "--backend",
                "sim",
            ],
            &format!("bench {op} runs on the cuda backend"),
        );
    }
    fails_with(
        &["bench", "gemm", "--m", "64", "--n", "64", "--k", "60"],
        "K must be a multiple of 8",
    );
    fails_with(
        &[
            "bench",
            "gemm",
            "--m",
            "64",
            "--n",
            "64",
            "--k",
            "64",
            "--b-layout",
            "kk",
        ],
        "unknown B layout 'kk'",
    );
    fails_with(&["bench", "gemm", "--m", "64", "--n", "64"], "--k");
    let gemm = ["bench", "gemm", "--m", "64", "--n", "64", "--k", "64"];
    for builds in ["auto", "wide", "main,none"] {
        let name = builds.rsplit(',').next().unwrap();
        fails_with(
            &[&gemm[..], &["--builds", builds]].concat(),
            &format!(
                "--builds takes main, skinny, narrow, narrow-deep, narrow-sliced, pair, mid, direct, ping-pong, mid-direct, short, ping-pong-wide or none, got '{name}'"
            ),
        );
    }
    fails_with(
        &[&gemm[..], &["--peer", "0"]].concat(),
        "is the GPU the GEMM runs on",
    );
    fails_with(
        &[&gemm[..], &["--peer", "two"]].concat(),
        "a GPU index or 'none'",
    );
    // the rank rows' options: the ring and the prefetch only beside --rs-ranks, and a
    // prefetch of at least one k-block
    for extra in [&["--rs-ring"][..], &["--rs-prefetch", "8"]] {
        fails_with(&[&gemm[..], extra].concat(), "--rs-ranks");
    }
    for k_blocks in ["0", "-3", "many"] {
        fails_with(
            &[&gemm[..], &["--rs-ranks", "2", "--rs-prefetch", k_blocks]].concat(),
            &format!("--rs-prefetch must be a positive number of k-blocks, got {k_blocks}"),
        );
    }
    fails_with(&["frobnicate"], "frobnicate");
}

#[test]
fn plan_prints_steps_verdict_and_cost_card() {
    let o = commfuse(&[
        "plan",
        "all-reduce",
        "--algo",
        "ring",
        "--ranks",
        "3",
        "--size",
        "9",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("rank 2:") && out.contains("reduce  rank 2 input[0..3)"),
        "{out}"
    );
    assert!(out.contains("checker: OK"), "{out}");
    assert!(out.contains("predicted time (slowest rank)"), "{out}");
    let o = commfuse(&[
        "plan",
        "reduce-scatter",
        "--algo",
        "ring",
        "--ranks",
        "4",
        "--json",
    ]);
    let plan: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(plan["steps"].as_array().unwrap().len(), 4);
    // with the default auto, --json is still only JSON
    let o = commfuse(&["plan", "all-gather", "--ranks", "3", "--json"]);
    let plan: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(plan["steps"].as_array().unwrap().len(), 3);
}

#[test]
fn bench_prints_nccl_tests_columns_and_writes_json() {
    // removed with everything in it when the test ends
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path().to_path_buf();
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("bench.json");
    let o = commfuse(&[
        "bench",
        "all-gather",
        "--algo",
        "all",
        "--ranks",
        "3",
        "--sizes",
        "4K..16K",
        "--dtype",
        "f16",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    for col in [
        "size",
        "count",
        "type",
        "time(us)",
        "algbw(GB/s)",
        "busbw(GB/s)",
        "#wrong",
    ] {
        assert!(out.contains(col), "{col} missing: {out}");
    }
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 9, "3 sizes × (2 algorithms + auto)");
    assert_eq!(rows.iter().filter(|r| r["algo"] == "auto").count(), 3);
    // every parameter the plans were built from
    for key in ["ranks", "dtype", "reduce", "root", "numa_groups"] {
        assert!(!report[key].is_null(), "{key} missing: {report}");
    }
    assert!(rows
        .iter()
        .all(|r| r["wrong"] == 0 && r["time_us"].as_f64().unwrap() > 0.0));
}

#[test]
fn dump_writes_npy_that_a_reader_checks() {
    use npyz::NpyFile;
    // removed with everything in it when the test ends
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path().to_path_buf();
    let o = commfuse(&[
        "run",
        "reduce-scatter",
        "--algo",
        "ring",
        "--ranks",
        "3",
        "--size",
        "10",
        "--seed",
        "5",
        "--dump",
        dir.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let read = |name: &str| -> Vec<f32> {
        let bytes = std::fs::read(dir.join(name)).unwrap();
        NpyFile::new(&bytes[..]).unwrap().into_vec().unwrap()
    };
    let inputs: Vec<Vec<f32>> = (0..3)
        .map(|r| read(&format!("rank{r}_input.npy")))
        .collect();
    // chunks of 10 over 3 ranks: 4, 3, 3
    for (r, range) in [(0, 0..4), (1, 4..7), (2, 7..10)] {
        let out = read(&format!("rank{r}_output.npy"));
        assert_eq!(out.len(), range.len());
        for (k, i) in range.enumerate() {
            let sum: f32 = inputs.iter().map(|x| x[i]).sum();
            assert!((out[k] - sum).abs() < 1e-5, "rank {r}[{k}]");
        }
    }
}

#[test]
fn verify_prints_the_matrix() {
    let o = commfuse(&["verify", "--ranks", "1,3"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("all-reduce      ring-2d     bf16"), "{out}");
    assert!(
        out.contains("gemm-rs         fused       bf16→bf16     2      OK"),
        "{out}"
    );
    assert!(
        out.contains("ag-gemm         overlap/2   f16→f32       2      OK"),
        "{out}"
    );
    assert!(out.contains(" 0 failed"), "{out}");
}

#[test]
fn the_long_commands_draw_no_progress_on_a_stderr_that_is_not_a_terminal() {
    // piped, as in scripts and logs: the results alone, as before there were bars
    for args in [
        &["verify", "--ranks", "2", "--seed", "1"][..],
        &[
            "bench",
            "all-reduce",
            "-p",
            "2",
            "--sizes",
            "4K,8K",
            "--iters",
            "1",
        ],
        &[
            "run", "gemm-rs", "--m", "64", "--n", "32", "--k", "16", "-p", "2",
        ],
    ] {
        let o = commfuse(args);
        assert_eq!(o.status.code(), Some(0), "{args:?}: {}", stderr(&o));
        assert_eq!(stderr(&o), "", "{args:?} wrote to stderr");
    }
}

#[test]
fn run_defaults_to_auto_and_says_what_it_chose() {
    let o = commfuse(&["run", "all-reduce", "--ranks", "3", "--size", "1000"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    let first = out.lines().next().unwrap();
    // the chosen algorithm by name, marked as the cost model's pick, and the cost card agrees
    let algo = first
        .strip_prefix("all-reduce ")
        .and_then(|rest| rest.split(" (auto: the cost model's pick)").next())
        .unwrap_or_else(|| panic!("no auto pick in: {first}"));
    assert!(first.contains("(auto: the cost model's pick)"), "{first}");
    assert!(
        out.contains(&format!("cost card: all-reduce {algo} on 3 ranks")),
        "{out}"
    );
    assert!(out.trim_end().ends_with("OK"), "{out}");
    fails_with(
        &["run", "all-reduce", "--algo", "all"],
        "--algo all is for bench",
    );
}

#[test]
fn run_prints_the_world_size_and_backend_it_ran_on() {
    let o = commfuse(&["run", "all-gather", "--ranks", "3", "--size", "30"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stdout(&o).contains(" on 3 ranks (sim)"), "{}", stdout(&o));
}

#[test]
fn bench_prints_the_auto_row_and_the_spread() {
    let o = commfuse(&[
        "bench",
        "reduce-scatter",
        "--algo",
        "all",
        "--ranks",
        "2",
        "--sizes",
        "4K",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("spread(us)"), "{out}");
    assert!(out.contains("interleaved rounds"), "{out}");
    let auto = out
        .lines()
        .find(|l| l.contains("auto="))
        .unwrap_or_else(|| panic!("no auto row: {out}"));
    // size, count, type, algo, time, spread "lo-hi"
    let spread = auto.split_whitespace().nth(5).unwrap();
    let (lo, hi) = spread.split_once('-').unwrap();
    let time: f64 = auto.split_whitespace().nth(4).unwrap().parse().unwrap();
    let (lo, hi): (f64, f64) = (lo.parse().unwrap(), hi.parse().unwrap());
    assert!(lo <= time && time <= hi, "{auto}");
    // the default is auto: one row, the pick
    let o = commfuse(&["bench", "all-reduce", "--ranks", "2", "--sizes", "1K"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .collect();
    assert_eq!(
        rows.len(),
        3,
        "the simulator's LL protocol, the auto row and the best-per-size row: {out}"
    );
    assert!(rows[0].split_whitespace().nth(3) == Some("ll"), "{rows:?}");
    assert!(rows[1].contains("auto="), "{rows:?}");
}

#[test]
fn help_shows_bench_gemm() {
    let o = commfuse(&["bench", "--help"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("commfuse bench <COMMAND>"), "{out}");
    assert!(
        out.lines().any(|l| l.trim_start().starts_with("gemm ")),
        "{out}"
    );
    let o = commfuse(&["--help"]);
    assert!(stdout(&o).contains("`bench gemm`"), "{}", stdout(&o));
    let o = commfuse(&["bench", "gemm", "--help"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    for flag in ["--m <M>", "--b-layout", "--sms", "--peer"] {
        assert!(stdout(&o).contains(flag), "{flag}: {}", stdout(&o));
    }
    fails_with(&["bench", "all-reduce", "gemm"], "cannot be used with");
}

/// A bench JSON "measured" by the model itself with known figures, on ring-2d with 4 NUMA
/// groups: calibrate must rebuild those plans (not the default single group) to fit it, and
/// reports the error on sizes it did not fit.
#[test]
fn calibrate_reads_back_numa_groups_and_reports_held_out_error() {
    use commfuse::core::topology::LinkModel;
    use commfuse::core::{Algo, DType, OpKind};
    use commfuse::driver::{plan, Request};
    let truth = LinkModel {
        link_gbps: 250.0,
        latency_us: 2.0,
        launch_us: 7.0,
    };
    let predict = |algo: Algo, count: usize, numa_groups: usize| {
        let mut req = Request::new(OpKind::AllReduce, algo, count, DType::BF16);
        req.numa_groups = numa_groups;
        let (checked, topology) = plan(&req, 8).unwrap();
        checked.timing(&topology.with_model(truth), 2).total_us()
    };
    let mut rows = Vec::new();
    for algo in [Algo::Ring2d, Algo::OneShot] {
        // small enough that latency counts: the steps of the plan decide the time
        for kb in [64u64, 128, 256, 512] {
            let bytes = kb << 10;
            let count = (bytes / 2) as usize;
            if algo == Algo::Ring2d {
                let (two, one) = (predict(algo, count, 4), predict(algo, count, 1));
                assert!(
                    (two - one).abs() > 0.05 * two,
                    "groups must matter: {two} {one}"
                );
            }
            let t = predict(algo, count, 4);
            rows.push(serde_json::json!({
                "algo": algo.name(), "bytes": bytes, "count": count, "dtype": "bf16",
                "time_us": t, "min_us": t, "max_us": t, "rounds": 5, "algbw_gbps": 0.0,
                "busbw_gbps": 0.0, "wrong": 0, "iterations": 5, "predicted_us": null,
                "baseline": false, "graph": false
            }));
        }
    }
    let report = serde_json::json!({
        "op": "all-reduce", "backend": "cuda", "ranks": 8, "dtype": "bf16", "reduce": "sum",
        "root": 0, "numa_groups": 4, "rows": rows, "skipped": []
    });
    // removed with everything in it when the test ends
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path().to_path_buf();
    std::fs::create_dir_all(&dir).unwrap();
    let (bench, out) = (dir.join("bench.json"), dir.join("fit.json"));
    std::fs::write(&bench, report.to_string()).unwrap();
    let o = commfuse(&[
        "calibrate",
        bench.to_str().unwrap(),
        "--min-size",
        "64K",
        "--json",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("held-out error"), "{text}");
    let fit: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let held = fit["held_out_worst_error"].as_f64().unwrap();
    assert!(held < 0.02, "held-out error {held}: {text}");
    // the single-group plans fit these rows too, but only with other figures (1.4 µs, 8.1 µs)
    assert!(
        (fit["link_gbps"].as_f64().unwrap() - 250.0).abs() < 15.0,
        "{fit}"
    );
    assert!(
        (fit["latency_us"].as_f64().unwrap() - 2.0).abs() < 0.2,
        "{fit}"
    );
    assert!(
        (fit["launch_us"].as_f64().unwrap() - 7.0).abs() < 0.5,
        "{fit}"
    );
    // one size only: nothing to hold out
    let one_size = serde_json::json!({
        "op": "all-reduce", "backend": "cuda", "ranks": 8, "dtype": "bf16", "reduce": "sum",
        "root": 0, "numa_groups": 4, "rows": [report["rows"][0]], "skipped": []
    });
    // a file from before bench recorded the plan parameters
    let old = dir.join("old.json");
    let mut without = report.clone();
    without.as_object_mut().unwrap().remove("numa_groups");
    std::fs::write(&old, without.to_string()).unwrap();
    fails_with(
        &["calibrate", old.to_str().unwrap()],
        "does not record the root and NUMA groups",
    );
    let one = dir.join("one-size.json");
    std::fs::write(&one, one_size.to_string()).unwrap();
    fails_with(
        &["calibrate", one.to_str().unwrap(), "--min-size", "1K"],
        "needs rows at two sizes or more",
    );
}

/// Every file the help text or the README names is in the repository, and neither points at
/// an issue tracker the repository does not carry.
#[test]
fn help_and_readme_name_only_files_in_the_repository() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut texts = vec![(
        "README.md".to_string(),
        std::fs::read_to_string(root.join("README.md")).unwrap(),
    )];
    for cmd in [
        &["--help"][..],
        &["run", "--help"],
        &["plan", "--help"],
        &["bench", "--help"],
        &["bench", "gemm", "--help"],
        &["verify", "--help"],
        &["kernels", "--help"],
        &["calibrate", "--help"],
    ] {
        texts.push((cmd.join(" "), stdout(&commfuse(cmd))));
    }
    let exists = |name: &str| {
        root.join(name).exists()
            || std::process::Command::new("git")
                .args(["ls-files", &format!("*{name}")])
                .current_dir(&root)
                .output()
                .map(|o| !o.stdout.is_empty())
                .unwrap_or(false)
    };
    for (what, text) in &texts {
        for word in text.split(|c: char| c.is_whitespace() || "`()[],;:'\"".contains(c)) {
            let word = word.trim_end_matches('.');
            if word.ends_with(".md") || word.ends_with(".sh") {
                assert!(
                    exists(word),
                    "{what} names {word}, which is not in the repository"
                );
            }
        }
        // the words built, so that this file itself does not speak of an issue tracker
        let issue = ["issue", "4"].join(" ");
        assert!(!text.contains(&issue), "{what} refers to '{issue}'");
    }
}

#[test]
fn run_gemm_rs_checks_every_element_on_the_simulator() {
    let o = commfuse(&[
        "run", "gemm-rs", "--ranks", "3", "--m", "300", "--n", "72", "--k", "64",
    ]);
    let out = stdout(&o);
    assert_eq!(o.status.code(), Some(0), "{out}{}", stderr(&o));
    assert!(out.contains("on 3 ranks (sim)"), "{out}");
    assert!(
        out.contains("call 0: M=300: checked 21600 elements"),
        "{out}"
    );
    assert!(
        out.contains("call 1: M=150: checked 10800 elements"),
        "{out}"
    );
    assert_eq!(out.lines().last(), Some("OK"), "{out}");
    let o = commfuse(&[
        "run",
        "gemm-rs",
        "--ranks",
        "5",
        "--m",
        "3",
        "--n",
        "8",
        "--k",
        "8",
        "--dtype",
        "f16",
        "--out-dtype",
        "f32",
        "--b-layout",
        "kn",
        "--bias",
        "--seed",
        "7",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}{}", stdout(&o), stderr(&o));
    assert!(stdout(&o).contains("f16 → f32, bias, on 5 ranks"));
    // auto names the path it took; each path can be asked for
    // (a reduce-scatter of under 4 MiB a rank: the unfused path)
    assert!(out.contains("unfused (auto)"), "{out}");
    for (path, says) in [
        (&["--path", "fused"][..], "(sim), fused, seed"),
        (
            &["--path", "overlapped", "--pieces", "3"][..],
            "overlapped (3 pieces), seed",
        ),
        (&["--path", "unfused"][..], "(sim), unfused, seed"),
        (
            &["--path", "overlapped", "--numa-groups", "2"][..],
            "overlapped (1 piece), 2D ring over 2 NUMA groups, seed",
        ),
    ] {
        let args: Vec<&str> = [
            "run", "gemm-rs", "--ranks", "4", "--m", "61", "--n", "16", "--k", "8",
        ]
        .iter()
        .chain(path)
        .copied()
        .collect();
        let o = commfuse(&args);
        assert_eq!(o.status.code(), Some(0), "{}{}", stdout(&o), stderr(&o));
        assert!(stdout(&o).contains(says), "{}", stdout(&o));
    }
}

#[test]
fn run_ag_gemm_checks_every_element_on_the_simulator() {
    let o = commfuse(&[
        "run", "ag-gemm", "--ranks", "3", "--m", "301", "--n", "72", "--k", "64", "--pieces", "2",
        "--bias",
    ]);
    let out = stdout(&o);
    assert_eq!(o.status.code(), Some(0), "{out}{}", stderr(&o));
    assert!(
        out.contains("on 3 ranks (sim), 2 pieces per chunk"),
        "{out}"
    );
    // every rank's whole [M, N] output
    assert!(
        out.contains("call 0: M=301: checked 65016 elements"),
        "{out}"
    );
    assert!(
        out.contains("call 1: M=151: checked 32616 elements"),
        "{out}"
    );
    assert_eq!(out.lines().last(), Some("OK"), "{out}");
    let o = commfuse(&[
        "run", "ag-gemm", "--ranks", "5", "--m", "301", "--n", "72", "--k", "64", "--pieces", "2",
        "--fused",
    ]);
    let out = stdout(&o);
    assert_eq!(o.status.code(), Some(0), "{out}{}", stderr(&o));
    assert!(
        out.contains("on 5 ranks (sim), fused, 2 pieces per chunk"),
        "{out}"
    );
    assert_eq!(out.lines().last(), Some("OK"), "{out}");
    // the path by name, as gemm-rs takes it (--fused is --path fused); auto and no --pieces:
    // the overlapped path in whole chunks
    for (extra, says) in [
        (
            &["--path", "fused", "--pieces", "2"][..],
            "(sim), fused, 2 pieces per chunk",
        ),
        (
            &["--path", "overlapped", "--pieces", "3"][..],
            "(sim), 3 pieces per chunk",
        ),
        (&["--path", "auto"][..], "(sim), 1 piece per chunk"),
        (&[][..], "(sim), 1 piece per chunk"),
    ] {
        let args: Vec<&str> = [
            "run", "ag-gemm", "--ranks", "3", "--m", "61", "--n", "24", "--k", "16",
        ]
        .iter()
        .chain(extra)
        .copied()
        .collect();
        let o = commfuse(&args);
        let out = stdout(&o);
        assert_eq!(o.status.code(), Some(0), "{args:?}: {out}{}", stderr(&o));
        assert!(out.contains(says), "{args:?}: {out}");
        assert_eq!(out.lines().last(), Some("OK"), "{args:?}: {out}");
    }
    let base = ["run", "ag-gemm", "--ranks", "3", "--m", "30", "--n", "16"];
    let with = |extra: &[&'static str]| -> Vec<&'static str> {
        base.iter().chain(extra).copied().collect()
    };
    fails_with(&with(&["--k", "12"]), "K must be a multiple of 8");
    fails_with(
        &with(&["--k", "8", "--path", "unfused"]),
        "unknown path \"unfused\": auto, overlapped or fused",
    );
    fails_with(
        &with(&["--k", "8", "--pieces", "0"]),
        "1 to 16 pieces, got 0",
    );
    fails_with(
        &with(&["--k", "8", "--out-dtype", "f16"]),
        "(the input type) or f32",
    );
}

#[test]
fn run_gemm_rs_refuses_bad_input_in_one_line() {
    let base = ["run", "gemm-rs", "--ranks", "3", "--m", "300", "--n", "72"];
    let with = |extra: &[&'static str]| -> Vec<&'static str> {
        base.iter().chain(extra).copied().collect()
    };
    fails_with(&with(&["--k", "12"]), "K must be a multiple of 8");
    fails_with(
        &with(&["--k", "8", "--out-dtype", "f16"]),
        "(the input type) or f32",
    );
    fails_with(
        &with(&["--k", "8", "--dtype", "f32"]),
        "GEMM inputs are bf16 or f16",
    );
    fails_with(
        &with(&["--k", "8", "--b-layout", "mn"]),
        "unknown B layout 'mn'",
    );
    fails_with(
        &[
            "run", "gemm-rs", "--ranks", "0", "--m", "3", "--n", "8", "--k", "8",
        ],
        "at least one rank",
    );
    fails_with(
        &[
            "run", "gemm-rs", "--ranks", "99", "--m", "3", "--n", "8", "--k", "8",
        ],
        "--ranks must be between 1 and",
    );
    fails_with(
        &with(&["--k", "8", "--devices", "0,1"]),
        "--ranks 3 disagrees with --devices 0,1 (2 GPUs, one rank each)",
    );
    fails_with(
        &[
            "run",
            "gemm-rs",
            "--m",
            "3",
            "--n",
            "8",
            "--k",
            "8",
            "--devices",
            "0",
            "--backend",
            "sim",
        ],
        "--devices 0 names GPUs, but --backend sim runs on the CPU",
    );
    fails_with(
        &[
            "run",
            "gemm-rs",
            "--m",
            "3",
            "--n",
            "8",
            "--k",
            "8",
            "--devices",
            "1,1",
        ],
        "device 1 is listed twice",
    );
    fails_with(
        &["run", "gemm-rs", "--m", "0", "--n", "8", "--k", "8"],
        "sizes must be positive",
    );
    fails_with(
        &with(&["--k", "8", "--path", "fast"]),
        "unknown path \"fast\": auto, fused, overlapped or unfused",
    );
    fails_with(
        &with(&["--k", "8", "--path", "overlapped", "--numa-groups", "2"]),
        "the 2D ring needs the world size (3) to be a multiple of the NUMA group count (2)",
    );
    fails_with(
        &with(&["--k", "8", "--path", "overlapped", "--pieces", "17"]),
        "1 to 16 pieces, got 17",
    );
    fails_with(
        &with(&["--k", "8", "--pieces", "2"]),
        "--pieces goes with --path overlapped",
    );
}

/// Fails unless the command exits with status 2 and prints one line on stderr starting with
/// `start` (the whole line, where it does not depend on the machine's memory), and no panic or
/// backtrace.
fn refused(args: &[&str], start: &str) -> Output {
    let o = commfuse(args);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "{args:?} printed more than one line:\n{err}"
    );
    assert!(
        err.starts_with(start),
        "{args:?}: expected '{start}…', got: {err}"
    );
    for sign in ["panicked", "backtrace", "internal error"] {
        assert!(!err.contains(sign), "{args:?}: {err}");
    }
    o
}

#[test]
fn inputs_too_big_for_memory_are_refused_before_anything_is_allocated() {
    let huge = ["--m", "100000000", "--n", "100000000", "--k", "8"];
    let gemm_rs = |extra: &[&'static str]| -> Vec<&'static str> {
        ["run", "gemm-rs"]
            .iter()
            .chain(&huge)
            .chain(extra)
            .copied()
            .collect()
    };
    refused(
        &gemm_rs(&[]),
        "error: run gemm-rs 100000000×100000000×8 on 2 ranks by the overlapped (2 pieces) path needs 346.4 PiB (390024444525294912 bytes), more than 90 % of the ",
    );
    refused(
        &gemm_rs(&["--path", "fused"]),
        "error: run gemm-rs 100000000×100000000×8 on 2 ranks by the fused path needs 346.5 PiB",
    );
    refused(
        &gemm_rs(&["--path", "unfused", "--ranks", "8"]),
        "error: run gemm-rs 100000000×100000000×8 on 8 ranks by the unfused path needs",
    );
    refused(
        &[
            "run", "gemm-rs", "--m", "2147483648", "--n", "2147483648", "--k", "8", "--path",
            "fused",
        ],
        "error: run gemm-rs 2147483648×2147483648×8 on 2 ranks by the fused path needs more bytes than 64 bits count (its size overflows)",
    );
    for fused in [&[][..], &["--fused"][..]] {
        let args: Vec<&str> = [
            "run", "ag-gemm", "--m", "2000000", "--n", "2000000", "--k", "8",
        ]
        .iter()
        .chain(fused)
        .copied()
        .collect();
        refused(
            &args,
            "error: run ag-gemm 2000000×2000000×8 on 2 ranks needs",
        );
    }
    // the queued calls' inputs and outputs count, not only the backend's buffers
    refused(
        &[
            "run", "all-reduce", "--algo", "ring", "--ranks", "64", "--size", "1000000000",
        ],
        "error: all-reduce ring of 1000000000 f32 elements on 64 ranks, 4 calls checked needs 1.9 TiB",
    );
    // a sweep is refused before its first size is measured
    let o = refused(
        &["bench", "all-reduce", "--ranks", "64", "--sizes", "1K,64G"],
        "error: bench all-reduce at 64G on 64 ranks needs",
    );
    assert!(!stdout(&o).contains("        1K "), "{}", stdout(&o));
}

#[test]
fn bad_values_and_flags_that_contradict_each_other_are_refused_in_one_line() {
    let gemm = ["--m", "64", "--n", "64", "--k", "8"];
    let with = |head: &[&'static str], tail: &[&'static str]| -> Vec<&'static str> {
        head.iter().chain(&gemm).chain(tail).copied().collect()
    };
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["run", "all-reduce", "--size", "-5"],
            "error: --size must be a non-negative number of elements, got -5",
        ),
        (
            vec!["plan", "all-reduce", "--size", "-5"],
            "error: --size must be a non-negative number of elements, got -5",
        ),
        (
            vec!["run", "gemm-rs", "--m", "-4", "--n", "8", "--k", "8"],
            "error: --m must be a non-negative number of rows, got -4",
        ),
        (
            vec!["run", "ag-gemm", "--m", "8", "--n", "-8", "--k", "8"],
            "error: --n must be a non-negative number of columns, got -8",
        ),
        (
            vec!["run", "all-reduce", "--ranks", "-2"],
            "error: --ranks must be a non-negative number of ranks, got -2",
        ),
        (
            vec!["run", "all-reduce", "--seed", "-1"],
            "error: --seed must be a whole number from 0 to 2^64 - 1, got -1",
        ),
        (
            vec!["run", "all-reduce", "--devices", "-1"],
            "error: --devices must be a GPU index (0, 1, ...), got -1",
        ),
        (
            vec!["run", "all-reduce", "--devices", "0,1", "--backend", "sim"],
            "error: --devices 0,1 names GPUs, but --backend sim runs on the CPU: drop one of the two",
        ),
        (
            vec!["bench", "all-reduce", "--devices", "0", "--backend", "sim"],
            "error: --devices 0 names GPUs, but --backend sim runs on the CPU: drop one of the two",
        ),
        (
            vec!["run", "all-reduce", "--devices", "0,1", "--ranks", "4"],
            "error: --ranks 4 disagrees with --devices 0,1 (2 GPUs, one rank each): drop --ranks or name 4 GPUs",
        ),
        (
            with(&["run", "gemm-rs"], &["--numa-groups", "2", "--path", "fused"]),
            "error: --numa-groups 2 shapes the overlapped path's ring; --path fused has none: drop --numa-groups, or take --path overlapped",
        ),
        (
            with(&["run", "gemm-rs"], &["--numa-groups", "2", "--path", "unfused"]),
            "error: --numa-groups 2 shapes the overlapped path's ring; --path unfused has none: drop --numa-groups, or take --path overlapped",
        ),
        (
            vec!["bench", "all-reduce", "--sizes", "0"],
            "error: --sizes: size list '0' has a size of 0 bytes: there is nothing to measure",
        ),
        (
            vec!["bench", "all-reduce", "--sizes", "1K,,2K"],
            "error: --sizes: size list '1K,,2K' has an empty item (write sizes such as 4K,1M or 1K..1G)",
        ),
        (
            vec!["bench", "all-reduce", "--sizes", "1K,"],
            "error: --sizes: size list '1K,' has an empty item (write sizes such as 4K,1M or 1K..1G)",
        ),
        (
            vec!["bench", "all-reduce", "--sizes", "-1K"],
            "error: --sizes: '-1K' is not a size (e.g. 4096, 64K, 16M, 1G)",
        ),
        (
            vec!["calibrate", "x.json", "--min-size", "-1"],
            "error: --min-size: '-1' is not a size (e.g. 4096, 64K, 16M, 1G)",
        ),
        (
            vec!["bench", "all-reduce", "--sizes", "2"],
            "error: --sizes 2: 2 bytes is less than one f32 element (4 bytes)",
        ),
        (
            vec!["bench", "all-reduce", "--iters", "0"],
            "error: --iters must be at least 1 (timed calls), got 0",
        ),
        (
            vec!["bench", "all-reduce", "--link-gbps", "0"],
            "error: --link-gbps must be a positive number of GB/s, got 0",
        ),
        (
            vec!["bench", "all-reduce", "--link-gbps", "nan"],
            "error: --link-gbps must be a positive number of GB/s, got nan",
        ),
        (
            vec!["bench", "all-reduce", "--latency-us", "-1"],
            "error: --latency-us must be a non-negative number of µs, got -1",
        ),
        (
            vec!["bench", "all-reduce", "--graph"],
            "error: --graph times replays of captured CUDA graphs, which the sim backend does not have: drop --graph, or run on --backend cuda",
        ),
        (
            vec!["verify", "--ranks", "2,2"],
            "error: --ranks 2,2 names world size 2 twice (the second time as item 2): name each once",
        ),
        (
            vec!["verify", "--devices", "0", "--ranks", "1,2"],
            "error: --ranks 1,2: world size 2 needs 2 GPUs, --devices 0 names 1",
        ),
        (
            vec!["verify", "--devices", "0", "--backend", "sim"],
            "error: --devices 0 names GPUs, but --backend sim runs on the CPU: drop one of the two",
        ),
        (
            with(&["run", "gemm-rs"], &["--path", "overlapped", "--pieces", "0"]),
            "error: --pieces must be 1 to 16 pieces, got 0",
        ),
        (
            with(&["run", "ag-gemm"], &["--pieces", "17"]),
            "error: --pieces must be 1 to 16 pieces, got 17",
        ),
        (
            with(&["bench", "gemm-rs"], &["--pieces", "1,0"]),
            "error: --pieces must be 1 to 16 pieces, got 0",
        ),
        (
            with(&["run", "gemm-rs"], &["--pieces", "2"]),
            "error: --pieces goes with --path overlapped",
        ),
    ];
    for (args, line) in &cases {
        let o = refused(args, line);
        assert_eq!(stderr(&o).trim_end(), *line, "{args:?}");
    }
}

#[test]
fn pieces_says_in_its_help_what_it_takes() {
    let o = commfuse(&["run", "gemm-rs", "--help"]);
    let help = stdout(&o).split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        help.contains("Row pieces per ring step, 1 to 16, with --path overlapped only (default: what auto would take for the shape)"),
        "{help}"
    );
    let o = commfuse(&["run", "ag-gemm", "--help"]);
    let help = stdout(&o).split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        help.contains("1 to 16: a GEMM per piece on the overlapped path, a wait per piece"),
        "{help}"
    );
}

#[test]
fn run_writes_its_result_as_json() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.json");
    let o = commfuse(&[
        "run",
        "reduce-scatter",
        "--ranks",
        "3",
        "--size",
        "1001",
        "--seed",
        "7",
        "--json",
        path.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(record["op"], "reduce-scatter", "{record}");
    assert_eq!(record["ranks"], 3, "{record}");
    assert_eq!(record["count"], 1001, "{record}");
    assert_eq!(record["seed"], 7, "{record}");
    assert_eq!(record["auto"], true, "{record}");
    assert_eq!(record["ok"], true, "{record}");
    assert_eq!(record["wrong"], 0, "{record}");
    assert!(record["checked"].as_u64().unwrap() > 0, "{record}");
    assert!(record["time_us"].as_f64().unwrap() > 0.0, "{record}");
    fails_with(
        &["run", "all-reduce", "--json", "/nonexistent-dir/run.json"],
        "cannot write /nonexistent-dir/run.json",
    );
}

#[test]
fn completions_cover_every_command() {
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let o = commfuse(&["completions", shell]);
        assert_eq!(o.status.code(), Some(0), "{shell}: {}", stderr(&o));
        let script = stdout(&o);
        for word in [
            "run",
            "plan",
            "bench",
            "verify",
            "kernels",
            "calibrate",
            "--ranks",
        ] {
            assert!(script.contains(word), "{shell}: no '{word}' in the script");
        }
    }
    fails_with(&["completions", "tcsh"], "invalid value 'tcsh'");
}

/// `commfuse kernels` finds NVRTC and the CUDA headers in a Python environment's pip-installed
/// NVIDIA wheels with no `LD_LIBRARY_PATH` or include folder given; and where there is none,
/// says in one line the command that installs them. `COMMFUSE_TEST_NVRTC_WHEELS` names a folder
/// holding the wheels' `nvidia/` (CI sets it; required under `COMMFUSE_REQUIRE_NVRTC`).
#[test]
fn kernels_find_nvrtc_in_a_python_environment() {
    let Some(venv) = commfuse_cuda::testing::venv_with_nvrtc_wheels() else {
        return;
    };
    let cache = tempfile::tempdir().unwrap();
    let bare = |venv: Option<&std::path::Path>| {
        let mut c = Command::new(binary());
        // one small file: finding NVRTC and the headers is what this checks, and gemm.cu
        // takes minutes (kernels_compile compiles every file)
        c.args(["kernels", "plan.cu"])
            .env_remove("LD_LIBRARY_PATH")
            .env_remove("COMMFUSE_CUDA_INCLUDE")
            .env_remove("CONDA_PREFIX")
            .env("PATH", "/nonexistent")
            .env("HOME", "/nonexistent")
            .env("COMMFUSE_KERNEL_CACHE", cache.path());
        match venv {
            Some(v) => c.env("VIRTUAL_ENV", v),
            None => c.env_remove("VIRTUAL_ENV"),
        };
        c.output().unwrap()
    };
    let o = bare(Some(venv.path()));
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("plan.cu: compiled for sm_90a"),
        "{}",
        stdout(&o)
    );
    assert!(!stdout(&o).contains("gemm.cu"), "{}", stdout(&o));
    let o = bare(None);
    if o.status.code() != Some(0) {
        let err = stderr(&o);
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        assert!(
            err.contains("pip install nvidia-cuda-nvrtc==13.0.88"),
            "{err}"
        );
    }
}

/// Whether the simulator runs `which` for `op`: every plan, and its twin of the LL kernels
/// for the reducing and gathering collectives (the rest are GPU kernels or GPU libraries).
fn sim_runs(op: commfuse_core::OpKind, which: commfuse_core::Implementation) -> bool {
    use commfuse_core::{Implementation, OpKind, Protocol};
    match which {
        Implementation::Plan(_) => true,
        Implementation::Protocol(p) => {
            p == Protocol::Ll
                && matches!(
                    op,
                    OpKind::AllReduce | OpKind::ReduceScatter | OpKind::AllGather
                )
        }
        Implementation::Baseline(_) => false,
    }
}

/// Every implementation the bench can print is a choice of `--algo` in `run`, `plan` and
/// `bench`: where the simulator has it, it runs, is checked and is named in the output; where it
/// does not, one line says which backend has what; `plan` lists plans and says of the others
/// that they have none.
#[test]
fn every_implementation_is_a_choice_of_algo_in_run_plan_and_bench() {
    use commfuse_core::{Implementation, OpKind};
    for op in OpKind::ALL {
        let name = op.name();
        for which in Implementation::for_op(op) {
            let algo = which.name();
            let run = ["run", name, "--algo", algo, "-p", "3", "-n", "100"];
            let bench = [
                "bench",
                name,
                "--algo",
                algo,
                "-p",
                "2",
                "--sizes",
                "4K",
                "--iters",
                "1",
                "--budget-ms",
                "5",
            ];
            if sim_runs(op, which) {
                let o = commfuse(&run);
                let out = stdout(&o);
                assert_eq!(o.status.code(), Some(0), "{run:?}: {}", stderr(&o));
                assert!(
                    out.starts_with(&format!("{name} {algo} on 3 ranks (sim)")),
                    "{run:?}: {out}"
                );
                assert!(out.trim_end().ends_with("OK"), "{run:?}: {out}");
                let o = commfuse(&bench);
                let out = stdout(&o);
                assert_eq!(o.status.code(), Some(0), "{bench:?}: {}", stderr(&o));
                let row = out
                    .lines()
                    .find(|l| !l.starts_with('#') && l.split_whitespace().nth(3) == Some(algo));
                assert!(row.is_some(), "{bench:?}: no {algo} row in {out}");
            } else {
                let needle = format!("the sim backend has no {algo} for {name} (it runs: ");
                fails_with(&run, &needle);
                fails_with(&bench, &needle);
                assert_eq!(commfuse(&run).status.code(), Some(2), "{run:?}");
            }
            let plan = ["plan", name, "--algo", algo, "-p", "3", "-n", "100"];
            if let Implementation::Plan(_) = which {
                let o = commfuse(&plan);
                assert_eq!(o.status.code(), Some(0), "{plan:?}: {}", stderr(&o));
                assert!(stdout(&o).contains("checker: OK"), "{plan:?}");
            } else {
                fails_with(&plan, "with no plan of steps to list");
                assert_eq!(commfuse(&plan).status.code(), Some(2), "{plan:?}");
            }
        }
    }
}

/// An unknown `--algo` ends with exit 2 and one line listing the op's choices, in each command;
/// each op's choices are in `--help`.
#[test]
fn an_unknown_algo_gets_one_line_listing_the_choices() {
    for cmd in ["run", "plan", "bench"] {
        let args = [cmd, "all-reduce", "--algo", "ll32"];
        fails_with(
            &args,
            "error: all-reduce has no algorithm 'll32' (choose auto, one of: two-phase, one-shot, one-shot-push, ring, ring-2d, ll, ll16, ce, nccl, or all with bench)",
        );
        assert_eq!(commfuse(&args).status.code(), Some(2), "{args:?}");
        let help = stdout(&commfuse(&[cmd, "--help"]));
        for op in commfuse_core::OpKind::ALL {
            let choices = commfuse_core::Implementation::names_for(op);
            assert!(
                help.contains(&format!("{op}: {choices}")),
                "{cmd} --help lacks {op}'s choices: {help}"
            );
        }
        assert!(
            help.contains("all-gather: direct, ring, ll, ll16, ce, nccl, copy-engine"),
            "{help}"
        );
    }
    // a baseline on its own, with the flag that skips baselines
    fails_with(
        &["bench", "broadcast", "--algo", "nccl", "--no-baselines"],
        "the sim backend has no nccl for broadcast",
    );
}

/// On GPUs every implementation of every op runs by name through `run --algo` on all the
/// machine's GPUs (up to 8), is checked and named.
#[test]
fn every_implementation_runs_by_name_on_gpus() {
    let gpus = commfuse_cuda::sys::driver::device_count().unwrap_or(0);
    if gpus == 0 {
        return commfuse_cuda::testing::skip("run --algo on the cuda backend: no GPU");
    }
    let devices: Vec<String> = (0..gpus.min(8)).map(|g| g.to_string()).collect();
    let devices = devices.join(",");
    for op in commfuse_core::OpKind::ALL {
        for which in commfuse_core::Implementation::for_op(op) {
            let (name, algo) = (op.name(), which.name());
            let args = [
                "run",
                name,
                "--algo",
                algo,
                "--devices",
                &devices,
                "-n",
                "4096",
            ];
            let o = commfuse(&args);
            let out = stdout(&o);
            assert_eq!(o.status.code(), Some(0), "{args:?}: {}", stderr(&o));
            assert!(
                out.starts_with(&format!("{name} {algo} on ")),
                "{args:?}: {out}"
            );
            assert!(out.trim_end().ends_with("OK"), "{args:?}: {out}");
        }
    }
}

/// On GPUs `run gemm-rs` takes every path and `run ag-gemm` both on all the machine's GPUs (up
/// to 8), their calls checked on every element, the path named; with one GPU everything is
/// local.
#[test]
fn fused_operators_run_by_every_path_on_gpus() {
    let gpus = commfuse_cuda::sys::driver::device_count().unwrap_or(0);
    if gpus == 0 {
        return commfuse_cuda::testing::skip("run gemm-rs on the cuda backend: no GPU");
    }
    let devices: Vec<String> = (0..gpus.min(8)).map(|g| g.to_string()).collect();
    let devices = devices.join(",");
    for (path, named) in [
        ("fused", "fused"),
        ("overlapped", "overlapped"),
        ("unfused", "unfused"),
        ("auto", ""),
    ] {
        let args = [
            "run",
            "gemm-rs",
            "--m",
            "300",
            "--n",
            "264",
            "--k",
            "64",
            "--bias",
            "--path",
            path,
            "--devices",
            &devices,
            "--seed",
            "7",
        ];
        let o = commfuse(&args);
        let out = stdout(&o);
        assert_eq!(o.status.code(), Some(0), "{args:?}: {}{out}", stderr(&o));
        assert!(out.contains("(cuda)"), "{args:?}: {out}");
        assert!(out.contains(named), "{args:?}: {out}");
        assert!(out.contains("call 1: M=150"), "{args:?}: {out}");
        assert!(out.trim_end().ends_with("OK"), "{args:?}: {out}");
    }
    for extra in [&[][..], &["--fused"][..], &["--pieces", "3"][..]] {
        let mut args = vec![
            "run",
            "ag-gemm",
            "--m",
            "301",
            "--n",
            "264",
            "--k",
            "64",
            "--bias",
            "--devices",
            &devices,
            "--seed",
            "8",
        ];
        args.extend_from_slice(extra);
        let o = commfuse(&args);
        let out = stdout(&o);
        assert_eq!(o.status.code(), Some(0), "{args:?}: {}{out}", stderr(&o));
        assert!(out.contains("(cuda)"), "{args:?}: {out}");
        assert!(out.contains("call 1: M=151"), "{args:?}: {out}");
        assert!(out.trim_end().ends_with("OK"), "{args:?}: {out}");
    }
}
