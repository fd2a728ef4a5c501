//! Where each field of a configuration file is written, so that problems
//! found after parsing (a lease shorter than the upstream timeout, a path
//! without its `/`) can name the line, as parse errors do. serde_yaml keeps
//! no positions once it has deserialized a value, so the text is read again,
//! as YAML events with their positions, and every key and sequence item is
//! recorded under the path validation messages use: `store.lease`,
//! `routes[2].path`.

use std::collections::HashMap;

use yaml_rust2::Event;
use yaml_rust2::parser::{MarkedEventReceiver, Parser};
use yaml_rust2::scanner::Marker;

/// The line (1-based) of each field and sequence item in a YAML text.
#[derive(Debug, Default)]
pub struct Lines {
    by_path: HashMap<String, Place>,
}

/// Where a field's value was written.
#[derive(Debug, Clone, Copy)]
enum Place {
    Line(usize),
    /// In the named environment variable.
    Environment(&'static str),
}

impl Lines {
    /// Reads `text`; a text this parser cannot read yields no lines, never
    /// an error (serde_yaml has already accepted it, and decides).
    pub fn of(text: &str) -> Self {
        let mut recorder = Recorder::default();
        if Parser::new_from_str(text)
            .load(&mut recorder, false)
            .is_err()
        {
            return Self::default();
        }
        Self {
            by_path: recorder
                .lines
                .into_iter()
                .map(|(path, line)| (path, Place::Line(line)))
                .collect(),
        }
    }

    /// Marks the field at `path` as set from the environment variable
    /// `variable`: it has no line, and does not take that of what encloses
    /// it.
    pub fn set_by_environment(&mut self, path: &str, variable: &'static str) {
        self.by_path
            .insert(path.to_owned(), Place::Environment(variable));
    }

    /// The line of the field at `path`, or of the closest enclosing field
    /// written in the file when that one was left to its default.
    #[cfg(test)]
    pub fn find(&self, path: &str) -> Option<usize> {
        match self.place(path)? {
            Place::Line(line) => Some(line),
            Place::Environment(_) => None,
        }
    }

    fn place(&self, path: &str) -> Option<Place> {
        let mut path = path;
        loop {
            if let Some(&place) = self.by_path.get(path) {
                return Some(place);
            }
            path = &path[..path.rfind(['.', '['])?];
        }
    }

    /// A validation problem, `FIELD: message` where FIELD may carry a
    /// route's name in parentheses (`routes[0] (orders).path`), with the
    /// field's line after it: `routes[0] (orders).path (line 7): message`,
    /// or where it came from: `store.url (from DEDUPE_STORE_URL): message`.
    pub fn annotate(&self, problem: String) -> String {
        let Some((field, message)) = problem.split_once(": ") else {
            return problem;
        };
        match self.place(&without_names(field)) {
            Some(Place::Line(line)) => format!("{field} (line {line}): {message}"),
            Some(Place::Environment(variable)) => format!("{field} (from {variable}): {message}"),
            None => problem,
        }
    }
}

/// `routes[0] (orders).path` to `routes[0].path`.
fn without_names(field: &str) -> String {
    let mut path = String::with_capacity(field.len());
    let mut rest = field;
    while let Some(start) = rest.find(" (") {
        path.push_str(&rest[..start]);
        match rest[start..].find(')') {
            Some(end) => rest = &rest[start + end + 1..],
            None => return path,
        }
    }
    path.push_str(rest);
    path
}

#[derive(Default)]
struct Recorder {
    lines: HashMap<String, usize>,
    open: Vec<Node>,
}

/// A mapping or sequence being read, with its own path.
enum Node {
    Mapping { path: String, key: Option<String> },
    Sequence { path: String, next: usize },
}

impl Recorder {
    /// The path of the value that starts now, recording where it is, and
    /// moving its parent on to the next key or item.
    fn value_path(&mut self, mark: Marker) -> Option<String> {
        let path = match self.open.last_mut() {
            None => return Some(String::new()),
            Some(Node::Mapping { path, key }) => {
                let key = key.take()?;
                join(path, &key)
            }
            Some(Node::Sequence { path, next }) => {
                let item = format!("{path}[{next}]");
                *next += 1;
                self.lines.entry(item.clone()).or_insert(mark.line());
                item
            }
        };
        Some(path)
    }
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

impl MarkedEventReceiver for Recorder {
    fn on_event(&mut self, event: Event, mark: Marker) {
        match event {
            Event::Scalar(text, ..) => {
                if let Some(Node::Mapping {
                    path,
                    key: key @ None,
                }) = self.open.last_mut()
                {
                    let field = join(path, &text);
                    self.lines.entry(field).or_insert(mark.line());
                    *key = Some(text);
                } else {
                    self.value_path(mark);
                }
            }
            Event::Alias(_) => {
                self.value_path(mark);
            }
            Event::MappingStart(..) | Event::SequenceStart(..) => {
                // A mapping used as a key has no path; its contents are
                // recorded under an empty one, where no field looks.
                let path = self.value_path(mark).unwrap_or_default();
                self.open.push(match event {
                    Event::MappingStart(..) => Node::Mapping { path, key: None },
                    _ => Node::Sequence { path, next: 0 },
                });
            }
            Event::MappingEnd | Event::SequenceEnd => {
                self.open.pop();
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "\
listen: 127.0.0.1:8080
store:
  url: sqlite://x.db
  lease: 5m
routes:
  - { name: orders, path: hooks/orders, key: { header: X-Event-Id } }
  - name: gh
    path: /gh
    methods: [POST, GET]
    handshakes:
      - json: /type
        equals: ping
";

    #[test]
    fn fields_and_items_are_found_in_block_and_flow_style() {
        let lines = Lines::of(TEXT);
        for (path, line) in [
            ("listen", 1),
            ("store", 2),
            ("store.lease", 4),
            ("routes", 5),
            ("routes[0]", 6),
            ("routes[0].path", 6),
            ("routes[0].key.header", 6),
            ("routes[1]", 7),
            ("routes[1].methods[1]", 9),
            ("routes[1].handshakes[0].equals", 12),
        ] {
            assert_eq!(lines.find(path), Some(line), "{path}");
        }
    }

    #[test]
    fn a_field_left_to_its_default_is_placed_at_what_encloses_it() {
        let lines = Lines::of(TEXT);
        assert_eq!(lines.find("routes[1].in_flight_status"), Some(7));
        assert_eq!(lines.find("store.timeout"), Some(2));
        assert_eq!(lines.find("upstream.timeout"), None);
    }

    #[test]
    fn problems_get_the_line_after_their_field() {
        let lines = Lines::of(TEXT);
        assert_eq!(
            lines.annotate("routes[0] (orders).path: must start with `/`".into()),
            "routes[0] (orders).path (line 6): must start with `/`"
        );
        assert_eq!(
            lines.annotate("store.lease: 5m must exceed upstream.timeout (10m)".into()),
            "store.lease (line 4): 5m must exceed upstream.timeout (10m)"
        );
        let unplaced = "upstream.url: not a URL".to_string();
        assert_eq!(lines.annotate(unplaced.clone()), unplaced);
    }

    #[test]
    fn a_field_set_from_outside_the_file_has_no_line() {
        let mut lines = Lines::of(TEXT);
        lines.set_by_environment("store.url", "DEDUPE_STORE_URL");
        assert_eq!(lines.find("store.url"), None);
        assert_eq!(lines.find("store.lease"), Some(4));
    }

    #[test]
    fn a_text_it_cannot_read_places_nothing() {
        let lines = Lines::of("routes: [ { name: x ");
        assert_eq!(lines.find("routes"), None);
    }
}
