//! The schedule every bench times its rows by: rows take turns in [`ROUNDS`] rounds, each round
//! starting one row further along, so that a drift of the machine (clocks, temperature, a
//! neighbour's load) falls on all rows alike and no row always follows the same neighbour. A
//! round times a few calls of one row and keeps their median; a row's time is the median of
//! its rounds' medians, its spread their minimum and maximum.
//!
//! Only the schedule and the statistics live here; how one round of one row is timed (CUDA
//! events on each rank's stream, the simulator's clock) is the caller's.

/// Rounds in which the rows take turns.
pub const ROUNDS: usize = 5;

/// Timed calls per round when `iters` calls are asked for in all (at least one).
pub fn calls_per_round(iters: usize) -> usize {
    iters.div_ceil(ROUNDS).max(1)
}

/// Untimed calls before a round's timed ones: `warmup` in the first round, which meets cold
/// caches and lazily loaded kernels, at most one in the others (the row's previous round is
/// far back).
pub fn warmup_of(round: usize, warmup: usize) -> usize {
    if round == 0 {
        warmup
    } else {
        warmup.min(1)
    }
}

/// Runs `measure(row, round)` for each of `rows` rows in each of [`ROUNDS`] rounds, round `r`
/// starting at row `r % rows`, then `after_round(round)`; returns per row what its rounds gave,
/// in round order. The first error ends the schedule.
pub fn interleaved<T, E>(
    rows: usize,
    mut measure: impl FnMut(usize, usize) -> Result<T, E>,
    mut after_round: impl FnMut(usize),
) -> Result<Vec<Vec<T>>, E> {
    let mut out: Vec<Vec<T>> = (0..rows).map(|_| Vec::with_capacity(ROUNDS)).collect();
    for round in 0..ROUNDS {
        for k in 0..rows {
            let row = (round + k) % rows;
            out[row].push(measure(row, round)?);
        }
        after_round(round);
    }
    Ok(out)
}

/// The middle element of `xs` (the upper middle for even lengths), sorting it in place; `None`
/// when it is empty. NaNs sort last.
pub fn median<T: PartialOrd + Copy>(xs: &mut [T]) -> Option<T> {
    xs.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Greater));
    xs.get(xs.len() / 2).copied()
}

/// A row's time and spread from its rounds' medians: (median, minimum, maximum); `None` when
/// there are none.
pub fn summary<T: PartialOrd + Copy>(round_medians: &[T]) -> Option<(T, T, T)> {
    let mut t = round_medians.to_vec();
    let mid = median(&mut t)?;
    Some((mid, t[0], t[t.len() - 1]))
}

/// The slowest rank's time of each call: `per_rank[r][i]` is call `i`'s time on rank `r`;
/// every rank times the same number of calls.
pub fn slowest_rank(per_rank: &[Vec<f64>]) -> Vec<f64> {
    let calls = per_rank.iter().map(Vec::len).min().unwrap_or(0);
    (0..calls)
        .map(|i| {
            per_rank
                .iter()
                .map(|t| t[i])
                .fold(f64::NEG_INFINITY, f64::max)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_round_starts_one_row_further() {
        let mut order = Vec::new();
        let mut ends = Vec::new();
        let got = interleaved(
            3,
            |row, round| -> Result<usize, ()> {
                order.push((round, row));
                Ok(round * 10 + row)
            },
            |round| ends.push(round),
        )
        .unwrap();
        let first_of_round: Vec<usize> = (0..ROUNDS).map(|r| order[r * 3].1).collect();
        assert_eq!(first_of_round, vec![0, 1, 2, 0, 1]);
        assert_eq!(ends, (0..ROUNDS).collect::<Vec<_>>());
        // every row once per round, its results in round order
        for (row, results) in got.iter().enumerate() {
            let expect: Vec<usize> = (0..ROUNDS).map(|r| r * 10 + row).collect();
            assert_eq!(results, &expect);
        }
    }

    #[test]
    fn an_error_ends_the_schedule() {
        let mut calls = 0;
        let got = interleaved(
            2,
            |row, round| {
                calls += 1;
                if round == 1 && row == 0 {
                    Err("row 0 failed")
                } else {
                    Ok(())
                }
            },
            |_| {},
        );
        assert_eq!(got, Err("row 0 failed"));
        // round 0: rows 0, 1; round 1 starts at row 1, then fails at row 0
        assert_eq!(calls, 4);
    }

    #[test]
    fn statistics() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&mut [4, 1, 3, 2]), Some(3));
        assert_eq!(median::<f64>(&mut []), None);
        assert_eq!(summary(&[5.0, 1.0, 3.0, 2.0, 4.0]), Some((3.0, 1.0, 5.0)));
        assert_eq!(
            slowest_rank(&[vec![1.0, 5.0, 2.0], vec![3.0, 4.0, 2.5]]),
            vec![3.0, 5.0, 2.5]
        );
        assert_eq!(calls_per_round(0), 1);
        assert_eq!(calls_per_round(11), 3);
        assert_eq!(
            (
                warmup_of(0, 0),
                warmup_of(0, 7),
                warmup_of(3, 7),
                warmup_of(3, 0)
            ),
            (0, 7, 1, 0)
        );
    }
}
