//! Arguments as Python passes them, refused in one line that names the argument and what it
//! takes: names given as something other than a string (`dtype=np.float16`), integers out of
//! range (`rank=-1`, `world=100`), arrays of another type or rank (float64, int, 1-D). The
//! extractions here never fail inside PyO3 (whose errors are TypeErrors and OverflowErrors
//! with a note on a second line); the checks run in the functions' bodies, as `ValueError`s.

use crate::value_error;
use numpy::{PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyString;
use std::fmt::Display;
use std::str::FromStr;

/// How an error names what was passed: a NumPy array by its type and shape, anything else by
/// its type and a short repr, on one line.
fn describe(obj: &Bound<'_, PyAny>) -> String {
    if let Ok(array) = obj.cast::<numpy::PyUntypedArray>() {
        let dims: Vec<String> = array.shape().iter().map(usize::to_string).collect();
        let shape = match dims.len() {
            1 => format!("({},)", dims[0]),
            _ => format!("({})", dims.join(", ")),
        };
        return format!(
            "a {}-D {} array of shape {shape}",
            array.ndim(),
            array
                .dtype()
                .str()
                .map_or_else(|_| "?".into(), |s| s.to_string()),
        );
    }
    let repr = obj
        .repr()
        .map_or_else(|_| "?".into(), |r| r.to_string())
        .replace('\n', " ");
    let repr = if repr.chars().count() > 60 {
        format!("{}...", repr.chars().take(57).collect::<String>())
    } else {
        repr
    };
    let kind = obj
        .get_type()
        .name()
        .map_or_else(|_| "?".into(), |n| n.to_string());
    format!("{repr} ({kind})")
}

/// A string argument (a dtype, a path, an op's name) as passed: its text, or a description of
/// the non-string given instead.
pub(crate) struct Name(Result<String, String>);

impl Name {
    /// The default `text`.
    pub(crate) fn new(text: &str) -> Name {
        Name(Ok(text.to_string()))
    }

    /// The text, or a one-line error: `what` must be a string naming one of `accepted`.
    pub(crate) fn text(&self, what: &str, accepted: &str) -> PyResult<&str> {
        self.0.as_deref().map_err(|got| {
            value_error(format!(
                "{what} must be a string naming {accepted}, got {got}"
            ))
        })
    }

    /// The text parsed as `T`, whose parse error lists the names it takes.
    pub(crate) fn parse<T: FromStr>(&self, what: &str, accepted: &str) -> PyResult<T>
    where
        T::Err: Display,
    {
        self.text(what, accepted)?.parse().map_err(value_error)
    }
}

impl<'py> FromPyObject<'_, 'py> for Name {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, 'py, PyAny>) -> PyResult<Self> {
        Ok(Name(match obj.cast::<PyString>() {
            Ok(s) => Ok(s.to_string()),
            Err(_) => Err(describe(&obj)),
        }))
    }
}

/// An integer argument as passed: its value, or a description of what was given instead
/// (a float, a string, an integer past 64 bits).
pub(crate) struct Int(Result<i64, String>);

impl Int {
    pub(crate) fn new(value: i64) -> Int {
        Int(Ok(value))
    }

    /// The value if it lies in `min..=max`, else a one-line error: `what` must be `says`.
    pub(crate) fn within(&self, what: &str, says: &str, (min, max): (i64, i64)) -> PyResult<usize> {
        match &self.0 {
            Ok(v) if (min..=max).contains(v) => Ok(*v as usize),
            Ok(v) => Err(value_error(format!("{what} must be {says}, got {v}"))),
            Err(got) => Err(value_error(format!("{what} must be {says}, got {got}"))),
        }
    }

    /// A value of at least 0.
    pub(crate) fn count(&self, what: &str, says: &str) -> PyResult<usize> {
        self.within(what, says, (0, i64::MAX))
    }
}

impl<'py> FromPyObject<'_, 'py> for Int {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, 'py, PyAny>) -> PyResult<Self> {
        // bools are ints to Python, but never what a size or a rank means
        if obj.is_instance_of::<pyo3::types::PyBool>() {
            return Ok(Int(Err(describe(&obj))));
        }
        Ok(Int(match obj.extract::<i64>() {
            Ok(v) => Ok(v),
            Err(_) => Err(describe(&obj)),
        }))
    }
}

/// `obj` as a 2-D float32 NumPy array, or a one-line error naming `what`.
pub(crate) fn matrix<'py>(
    obj: &Bound<'py, PyAny>,
    what: &str,
) -> PyResult<PyReadonlyArray2<'py, f32>> {
    match obj.cast::<numpy::PyArray2<f32>>() {
        Ok(array) => array.try_readonly().map_err(value_error),
        Err(_) => Err(value_error(format!(
            "{what} must be a 2-D float32 NumPy array (convert with numpy.asarray(x, numpy.float32)), got {}",
            describe(obj)
        ))),
    }
}

/// `obj` as a 1-D float32 NumPy array, or a one-line error naming `what`.
pub(crate) fn vector<'py>(
    obj: &Bound<'py, PyAny>,
    what: &str,
) -> PyResult<PyReadonlyArray1<'py, f32>> {
    match obj.cast::<numpy::PyArray1<f32>>() {
        Ok(array) => array.try_readonly().map_err(value_error),
        Err(_) => Err(value_error(format!(
            "{what} must be a 1-D float32 NumPy array (convert with numpy.asarray(x, numpy.float32)), got {}",
            describe(obj)
        ))),
    }
}

/// `obj` as a list of `item`s (one per rank), or a one-line error naming `what`: `what[i]` for
/// a bad item.
pub(crate) fn per_rank<'py, T>(
    obj: &Bound<'py, PyAny>,
    what: &str,
    item: impl Fn(&Bound<'py, PyAny>, &str) -> PyResult<T>,
) -> PyResult<Vec<T>> {
    let not_a_list = || {
        value_error(format!(
            "{what} must be a list or tuple with one array per rank, got {}",
            describe(obj)
        ))
    };
    if obj.is_instance_of::<PyString>() {
        return Err(not_a_list());
    }
    let items = obj.try_iter().map_err(|_| not_a_list())?;
    items
        .enumerate()
        .map(|(r, x)| item(&x?, &format!("{what}[{r}]")))
        .collect()
}
