//! Sizes and durations on the command line.
//!
//! Sizes are binary (IEC): `4k` = 4096, `1G` = 1 GiB, as rbd, LVM and fio
//! read them; a bare number is bytes.

use std::time::Duration;

pub use nvpool_api::size::parse_size;

/// A byte count for people, in IEC units with one decimal: `512 B`,
/// `4.0 KiB`, `10.0 GiB`, `1.5 TiB`.
pub fn format_iec(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    // Round first so 1023.96 KiB prints as 1.0 MiB, not 1024.0 KiB.
    while (v * 10.0).round() / 10.0 >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// `10s`, `500ms`, `2m`, or bare seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let end = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(end);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (examples: 10s, 500ms, 2m)"))?;
    let secs = match unit {
        "" | "s" => n,
        "ms" => n / 1000.0,
        "m" | "min" => n * 60.0,
        _ => return Err(format!("{s:?} has an unknown unit (use ms, s or m)")),
    };
    if !(0.0..=86400.0).contains(&secs) {
        return Err(format!("{s:?} is out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_binary() {
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("128K").unwrap(), 128 << 10);
        assert_eq!(parse_size("10G").unwrap(), 10 << 30);
        assert_eq!(parse_size("1TiB").unwrap(), 1 << 40);
        assert!(parse_size("4q").is_err());
        assert!(parse_size("k").is_err());
    }

    #[test]
    fn iec_output() {
        assert_eq!(format_iec(0), "0 B");
        assert_eq!(format_iec(1023), "1023 B");
        assert_eq!(format_iec(4096), "4.0 KiB");
        assert_eq!(format_iec(10 << 30), "10.0 GiB");
        assert_eq!(format_iec(3 << 39), "1.5 TiB");
        assert_eq!(format_iec((1 << 20) - 1), "1.0 MiB");
        assert_eq!(format_iec(u64::MAX), "16.0 EiB");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert!(parse_duration("-1").is_err());
        assert!(parse_duration("3h").is_err());
    }
}
