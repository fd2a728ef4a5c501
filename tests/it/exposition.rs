//! A parser for the Prometheus text exposition format (0.0.4), strict enough
//! to fail on malformed output: `# HELP` / `# TYPE` lines and samples with
//! escaped label values.

use std::collections::{BTreeMap, HashMap};

/// A series' labels in name order.
pub type Labels = Vec<(String, String)>;

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// A parsed exposition.
#[derive(Debug, Default)]
pub struct Exposition {
    /// Metric family name to its `# TYPE`.
    pub types: HashMap<String, String>,
    /// Metric family name to its `# HELP`.
    pub help: HashMap<String, String>,
    pub samples: Vec<Sample>,
}

impl Exposition {
    pub fn parse(text: &str) -> Self {
        let mut exposition = Exposition::default();
        for (number, line) in text.lines().enumerate() {
            let fail = |why: &str| -> ! { panic!("line {}: {why}: {line:?}", number + 1) };
            if line.is_empty() {
                continue;
            }
            if let Some(comment) = line.strip_prefix("# ") {
                let (keyword, rest) = comment.split_once(' ').unwrap_or((comment, ""));
                let (name, value) = rest.split_once(' ').unwrap_or_else(|| fail("comment"));
                match keyword {
                    "TYPE" => {
                        let known = ["counter", "gauge", "histogram", "summary", "untyped"];
                        if !known.contains(&value) {
                            fail("unknown type");
                        }
                        if exposition.types.insert(name.into(), value.into()).is_some() {
                            fail("second TYPE line");
                        }
                    }
                    "HELP" => {
                        exposition.help.insert(name.into(), value.into());
                    }
                    _ => {}
                }
                continue;
            }
            let sample = parse_sample(line).unwrap_or_else(|why| fail(&why));
            exposition.samples.push(sample);
        }
        exposition
    }

    /// The value of the sample with exactly these labels.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let wanted: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let mut found = self
            .samples
            .iter()
            .filter(|s| s.name == name && s.labels == wanted);
        let sample = found.next()?;
        assert!(found.next().is_none(), "{name} {labels:?} appears twice");
        Some(sample.value)
    }

    /// Every sample of a name, as (labels, value), ignoring histogram
    /// buckets' `le`.
    pub fn series(&self, name: &str) -> BTreeMap<Labels, f64> {
        self.samples
            .iter()
            .filter(|s| s.name == name)
            .map(|s| (s.labels.clone().into_iter().collect(), s.value))
            .collect()
    }

    /// The family a sample belongs to: histogram samples carry suffixes.
    pub fn family<'a>(&self, sample: &'a str) -> &'a str {
        for suffix in ["_bucket", "_sum", "_count"] {
            if let Some(base) = sample.strip_suffix(suffix)
                && self.types.get(base).map(String::as_str) == Some("histogram")
            {
                return base;
            }
        }
        sample
    }
}

fn parse_sample(line: &str) -> Result<Sample, String> {
    let name_end = line.find(['{', ' ']).ok_or("no value")?;
    let name = &line[..name_end];
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    {
        return Err(format!("bad metric name {name:?}"));
    }
    let mut rest = &line[name_end..];
    let mut labels = BTreeMap::new();
    if let Some(body) = rest.strip_prefix('{') {
        rest = parse_labels(body, &mut labels)?;
    }
    let rest = rest.strip_prefix(' ').ok_or("no space before the value")?;
    // An optional timestamp (integer milliseconds) may follow the value.
    let (value, timestamp) = rest.split_once(' ').unwrap_or((rest, "0"));
    timestamp
        .parse::<i64>()
        .map_err(|_| format!("bad timestamp {timestamp:?}"))?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        number => number
            .parse()
            .map_err(|_| format!("bad value {number:?}"))?,
    };
    Ok(Sample {
        name: name.into(),
        labels,
        value,
    })
}

/// Parses `name="value",…}` and returns what follows the brace.
fn parse_labels<'a>(
    mut body: &'a str,
    labels: &mut BTreeMap<String, String>,
) -> Result<&'a str, String> {
    loop {
        if let Some(rest) = body.strip_prefix('}') {
            return Ok(rest);
        }
        let (name, rest) = body.split_once("=\"").ok_or("label without =\"")?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next().ok_or("unterminated label value")? {
                (i, '"') => break i,
                (_, '\\') => match chars.next().ok_or("dangling escape")?.1 {
                    'n' => value.push('\n'),
                    c @ ('\\' | '"') => value.push(c),
                    c => return Err(format!("bad escape \\{c}")),
                },
                (_, c) => value.push(c),
            }
        };
        if labels.insert(name.into(), value).is_some() {
            return Err(format!("label {name} twice"));
        }
        body = &rest[end + 1..];
        body = body.strip_prefix(',').unwrap_or(body);
    }
}

#[test]
fn the_parser_reads_labels_escapes_and_special_values() {
    let text = "# HELP a_total A counter.\n# TYPE a_total counter\na_total{x=\"q\\\"uote\",y=\"b\\\\s\\n\"} 3\n# TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_sum 0.5\nh_count 2\n";
    let parsed = Exposition::parse(text);
    assert_eq!(parsed.types["a_total"], "counter");
    assert_eq!(
        parsed.value("a_total", &[("x", "q\"uote"), ("y", "b\\s\n")]),
        Some(3.0)
    );
    assert_eq!(parsed.value("h_bucket", &[("le", "+Inf")]), Some(2.0));
    assert_eq!(parsed.family("h_count"), "h");
    assert_eq!(parsed.family("a_total"), "a_total");
    assert!(std::panic::catch_unwind(|| Exposition::parse("a{x=\"1} 2\n")).is_err());
    assert_eq!(Exposition::parse("a 1 17\n").value("a", &[]), Some(1.0));
    assert!(std::panic::catch_unwind(|| Exposition::parse("a 1 2 x\n")).is_err());
}
