//! Byte counts as people write them to any nvpool program (the CLI's
//! options, the target's backend specs): binary (IEC) units, `4k` = 4096,
//! `1G` = 1 GiB, as rbd, LVM and fio read them; a bare number is bytes.

/// Parses digits with an optional unit k, M, G or T (any case), which may
/// be followed by `B` or `iB`: `4096`, `4k`, `512MiB`, `2T`. A unit with a
/// bare `i` (`1Ki`) is refused: IEC writes `KiB`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(end);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (examples: 4k, 128K, 1G)"))?;
    let shift = match unit
        .to_ascii_lowercase()
        .trim_end_matches("ib")
        .trim_end_matches('b')
    {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        _ => return Err(format!("{s:?} has an unknown unit (use k, M, G or T)")),
    };
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("{s:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn a_bare_i_is_not_a_unit() {
        assert!(parse_size("1Ki").is_err());
        assert_eq!(parse_size("1KiB").unwrap(), 1 << 10);
        assert_eq!(parse_size("1kb").unwrap(), 1 << 10);
    }
}
