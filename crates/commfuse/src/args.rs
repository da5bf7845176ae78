//! What the command line takes as a number: parsers that name the flag and say what it must be
//! ("--size must be a non-negative number of elements, got -5"), for the flags that also take
//! negative numbers as values so that a sign reaches them instead of reading as a flag.

use clap::builder::TypedValueParser;
use clap::error::ErrorKind;
use std::ffi::OsStr;
use std::marker::PhantomData;

/// The flag as the user wrote it: `--size`, or `<OP>` for a positional.
fn flag(arg: Option<&clap::Arg>) -> String {
    match arg {
        Some(a) => match a.get_long() {
            Some(long) => format!("--{long}"),
            None => format!("<{}>", a.get_id().as_str().to_uppercase()),
        },
        None => "the value".into(),
    }
}

fn invalid(arg: Option<&clap::Arg>, says: &str, got: &OsStr) -> clap::Error {
    clap::Error::raw(
        ErrorKind::ValueValidation,
        format!(
            "{} must be {says}, got {}\n",
            flag(arg),
            got.to_string_lossy()
        ),
    )
}

/// A whole number from `min` to `max`, each of a comma-separated list alike; `says` is what the
/// error calls it ("a non-negative number of elements").
#[derive(Clone)]
pub struct Whole<T> {
    min: u64,
    max: u64,
    says: &'static str,
    _type: PhantomData<fn() -> T>,
}

impl<T> Whole<T> {
    pub fn new(says: &'static str) -> Self {
        Whole {
            min: 0,
            max: u64::MAX,
            says,
            _type: PhantomData,
        }
    }

    /// Refuses numbers below `min`.
    pub fn at_least(self, min: u64) -> Self {
        Whole { min, ..self }
    }

    /// Refuses numbers above `max`.
    pub fn at_most(self, max: u64) -> Self {
        Whole { max, ..self }
    }
}

impl<T> TypedValueParser for Whole<T>
where
    T: TryFrom<u64> + Clone + Send + Sync + 'static,
{
    type Value = T;

    fn parse_ref(
        &self,
        _cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &OsStr,
    ) -> Result<T, clap::Error> {
        let text = value.to_string_lossy();
        let number: u64 = text
            .trim()
            .parse()
            .map_err(|_| invalid(arg, self.says, value))?;
        if number < self.min || number > self.max {
            return Err(invalid(arg, self.says, value));
        }
        T::try_from(number).map_err(|_| invalid(arg, self.says, value))
    }
}

/// A finite number above `min` (or at least `min` with `inclusive`), for the cost model's
/// figures.
#[derive(Clone)]
pub struct Real {
    min: f64,
    inclusive: bool,
    says: &'static str,
}

impl Real {
    /// A number above 0.
    pub fn positive(says: &'static str) -> Self {
        Real {
            min: 0.0,
            inclusive: false,
            says,
        }
    }

    /// A number of at least 0.
    pub fn non_negative(says: &'static str) -> Self {
        Real {
            min: 0.0,
            inclusive: true,
            says,
        }
    }
}

impl TypedValueParser for Real {
    type Value = f64;

    fn parse_ref(
        &self,
        _cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &OsStr,
    ) -> Result<f64, clap::Error> {
        let text = value.to_string_lossy();
        let x: f64 = text
            .trim()
            .parse()
            .map_err(|_| invalid(arg, self.says, value))?;
        let above = if self.inclusive {
            x >= self.min
        } else {
            x > self.min
        };
        if !x.is_finite() || !above {
            return Err(invalid(arg, self.says, value));
        }
        Ok(x)
    }
}

/// Element counts.
pub fn elements() -> Whole<usize> {
    Whole::new("a non-negative number of elements")
}

/// World sizes (their range is checked where the world is made, with the op's limits).
pub fn ranks() -> Whole<usize> {
    Whole::new("a non-negative number of ranks")
}

/// Rows of A (M).
pub fn rows() -> Whole<usize> {
    Whole::new("a non-negative number of rows")
}

/// Columns of B (N).
pub fn columns() -> Whole<usize> {
    Whole::new("a non-negative number of columns")
}

/// K.
pub fn depth() -> Whole<usize> {
    Whole::new("a non-negative number of columns of A (a multiple of 8)")
}

/// Row pieces of the fused operators.
pub fn pieces() -> Whole<usize> {
    Whole::new("1 to 16 pieces").at_least(1).at_most(16)
}

/// NUMA groups.
pub fn groups() -> Whole<usize> {
    Whole::new("a non-negative number of NUMA groups")
}

/// GPU ordinals.
pub fn gpu() -> Whole<usize> {
    Whole::new("a GPU index (0, 1, ...)")
}

/// Untimed calls.
pub fn warmup() -> Whole<usize> {
    Whole::new("a non-negative number of calls")
}

/// Timed calls.
pub fn iters() -> Whole<usize> {
    Whole::new("at least 1 (timed calls)").at_least(1)
}

/// Durations in milliseconds.
pub fn millis() -> Whole<u64> {
    Whole::new("a non-negative number of milliseconds")
}

/// Seeds.
pub fn seed() -> Whole<u64> {
    Whole::new("a whole number from 0 to 2^64 - 1")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Try {
        #[arg(long, allow_negative_numbers = true, value_parser = Whole::<usize>::new("a non-negative number of elements"))]
        size: Option<usize>,
        #[arg(long, allow_negative_numbers = true, value_parser = Whole::<usize>::new("1 to 16 pieces").at_least(1).at_most(16))]
        pieces: Option<usize>,
        #[arg(long, allow_negative_numbers = true, value_delimiter = ',', value_parser = Whole::<usize>::new("a GPU index"))]
        devices: Option<Vec<usize>>,
        #[arg(long, allow_negative_numbers = true, value_parser = Real::positive("a positive number of GB/s"))]
        gbps: Option<f64>,
    }

    fn error(args: &[&str]) -> String {
        let mut all = vec!["try"];
        all.extend(args);
        Try::try_parse_from(all).unwrap_err().to_string()
    }

    #[test]
    fn numbers_out_of_range_name_the_flag_and_what_it_takes() {
        let ok = Try::try_parse_from(["try", "--size", "0", "--pieces", "16", "--devices", "0,3"])
            .unwrap();
        assert_eq!(
            (ok.size, ok.pieces, ok.devices),
            (Some(0), Some(16), Some(vec![0, 3]))
        );
        assert!(error(&["--size", "-5"])
            .starts_with("error: --size must be a non-negative number of elements, got -5"));
        assert!(error(&["--size", "1.5"]).contains("got 1.5"));
        assert!(error(&["--pieces", "0"]).contains("--pieces must be 1 to 16 pieces, got 0"));
        assert!(error(&["--pieces", "17"]).contains("1 to 16 pieces, got 17"));
        assert!(error(&["--devices", "0,-1"]).contains("--devices must be a GPU index, got -1"));
        for bad in ["0", "-3", "nan", "inf"] {
            assert!(
                error(&["--gbps", bad]).contains(&format!("a positive number of GB/s, got {bad}")),
                "{bad}"
            );
        }
    }
}
