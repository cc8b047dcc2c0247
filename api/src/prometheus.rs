//! Prometheus' text exposition format (version 0.0.4), the one writer of
//! the control plane's and the agent's `/metrics` (feature `server`):
//! `# HELP` and `# TYPE` lines, samples with escaped label values, and a
//! histogram's `_bucket`, `_sum` and `_count` lines.

use std::fmt::{Display, Write as _};

/// What a metric family is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// A text exposition being written: families one after the other, each
/// its HELP and TYPE lines, then its samples.
#[derive(Debug, Default)]
pub struct Text {
    out: String,
}

impl Text {
    pub fn new() -> Text {
        Text::default()
    }

    /// Starts the family `name`: `help` is one line for humans.
    pub fn family(&mut self, name: &str, kind: Kind, help: &str) -> &mut Text {
        let help = help.replace('\\', "\\\\").replace('\n', "\\n");
        // Writing to a String cannot fail: the results are ignored.
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {}", kind.name());
        self
    }

    /// One sample: `name{label="value",…} value` (no braces without labels).
    pub fn sample(
        &mut self,
        name: &str,
        labels: &[(&str, &str)],
        value: impl Display,
    ) -> &mut Text {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{k}=\"{}\"", escape(v));
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {value}");
        self
    }

    /// One histogram of the family `name`: `buckets` are each bucket's
    /// upper bound and its own count (made cumulative here), `total` every
    /// observation (the `+Inf` bucket), `sum` and `count` as observed.
    pub fn histogram(
        &mut self,
        name: &str,
        labels: &[(&str, &str)],
        buckets: impl IntoIterator<Item = (f64, u64)>,
        total: u64,
        sum: f64,
        count: u64,
    ) -> &mut Text {
        let bucket = format!("{name}_bucket");
        let mut cumulative = 0;
        for (bound, n) in buckets {
            cumulative += n;
            let bound = bound.to_string();
            self.sample(&bucket, &[labels, &[("le", &bound)]].concat(), cumulative);
        }
        self.sample(&bucket, &[labels, &[("le", "+Inf")]].concat(), total);
        self.sample(&format!("{name}_sum"), labels, sum);
        self.sample(&format!("{name}_count"), labels, count)
    }

    pub fn finish(self) -> String {
        self.out
    }
}

/// A label value as the format quotes it: `\`, `"` and newlines escaped.
pub fn escape(v: &str) -> std::borrow::Cow<'_, str> {
    if !v.contains(['\\', '"', '\n']) {
        return v.into();
    }
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
        .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_samples_and_histograms() {
        let mut t = Text::new();
        t.family("up", Kind::Gauge, "Whether it is up.")
            .sample("up", &[], 1)
            .sample("up", &[("target", "a\"b\\c\nd")], 0);
        t.family("lat", Kind::Histogram, "Latency.").histogram(
            "lat",
            &[("op", "read")],
            [(0.000001, 1), (0.000002, 2)],
            4,
            0.5,
            4,
        );
        assert_eq!(
            t.finish(),
            "# HELP up Whether it is up.\n# TYPE up gauge\nup 1\n\
             up{target=\"a\\\"b\\\\c\\nd\"} 0\n\
             # HELP lat Latency.\n# TYPE lat histogram\n\
             lat_bucket{op=\"read\",le=\"0.000001\"} 1\n\
             lat_bucket{op=\"read\",le=\"0.000002\"} 3\n\
             lat_bucket{op=\"read\",le=\"+Inf\"} 4\n\
             lat_sum{op=\"read\"} 0.5\nlat_count{op=\"read\"} 4\n"
        );
    }
}
