//! Size lists as users of nccl-tests write them: `64M`, `1K..1G` (doubling), `4K,1M,16M`.

use anyhow::{anyhow, bail, Result};

/// Parses one size with an optional K, M or G suffix (powers of 1024).
pub fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    let (digits, unit) = match t.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => t.split_at(i),
        None => (t, ""),
    };
    let base: u64 = digits
        .parse()
        .map_err(|_| anyhow!("'{text}' is not a size (e.g. 4096, 64K, 16M, 1G)"))?;
    let scale: u64 = match unit.to_ascii_uppercase().trim_end_matches(['B', 'I']) {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        "T" => 1 << 40,
        _ => bail!("'{text}' has an unknown unit (use K, M or G)"),
    };
    base.checked_mul(scale)
        .ok_or_else(|| anyhow!("size '{text}' overflows"))
}

/// Parses a size list: `A..B` doubles from A to B, commas separate items. Every item names a
/// size above 0: an empty item (`1K,,2K`, a trailing comma) or a zero is refused rather than
/// skipped or measured as nothing.
pub fn parse_sizes(text: &str) -> Result<Vec<u64>> {
    let mut out = Vec::new();
    for item in text.split(',') {
        if item.trim().is_empty() {
            bail!("size list '{text}' has an empty item (write sizes such as 4K,1M or 1K..1G)");
        }
        if let Some((lo, hi)) = item.split_once("..") {
            let (lo, hi) = (parse_size(lo)?, parse_size(hi)?);
            if lo == 0 || lo > hi {
                bail!("size range '{item}' must go up from a non-zero size");
            }
            let mut s = lo;
            while s <= hi {
                out.push(s);
                s = match s.checked_mul(2) {
                    Some(next) => next,
                    None => break,
                };
            }
        } else {
            let size = parse_size(item)?;
            if size == 0 {
                bail!("size list '{text}' has a size of 0 bytes: there is nothing to measure");
            }
            out.push(size);
        }
    }
    Ok(out)
}

/// Human form of a byte count: 4K, 16M, 1G, or plain bytes.
pub fn format_size(bytes: u64) -> String {
    for (unit, shift) in [("G", 30), ("M", 20), ("K", 10)] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sizes() {
        assert_eq!(parse_size("64M").unwrap(), 64 << 20);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_sizes("1K..8K").unwrap(), vec![1024, 2048, 4096, 8192]);
        assert_eq!(parse_sizes("4K,1M").unwrap(), vec![4096, 1 << 20]);
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("x").is_err());
        assert!(parse_size("99999999999G").is_err());
        assert!(parse_sizes("8K..1K").is_err());
        for bad in ["", "1K,,2K", "1K,", ",1K", " , ", "0", "4K,0"] {
            let err = parse_sizes(bad).unwrap_err().to_string();
            assert!(
                err.contains("empty item") || err.contains("0 bytes"),
                "{bad}: {err}"
            );
        }
        assert_eq!(format_size(16 << 20), "16M");
        assert_eq!(format_size(1000), "1000");
    }
}
