//! Whether the table `store.table` names is the claims table: its columns,
//! their types and `NOT NULL`s, the key the claim's `ON CONFLICT` needs, and
//! the index the pruner reads, as PostgreSQL's catalog describes them. A
//! table made by hand, or some other table, is refused by name, saying what
//! differs, instead of being written to.

use tokio_postgres::types::Type;

use super::postgres_error;
use crate::store::StoreError;

/// The claims table's columns, their types as `format_type` writes them, and
/// whether they are `NOT NULL`. The statements decode `attempts` and
/// `response_status` as these exact integer types, read the timestamps
/// without expecting a NULL, and claim through the primary key.
const CLAIMS_COLUMNS: [(&str, &str, bool); 10] = [
    ("source", "text", true),
    ("event_id", "text", true),
    ("status", "text", true),
    ("attempts", "integer", true),
    ("payload_sha256", "bytea", false),
    ("response_status", "smallint", false),
    ("received_at", "timestamp with time zone", true),
    ("claimed_at", "timestamp with time zone", true),
    ("lease_expires_at", "timestamp with time zone", false),
    ("completed_at", "timestamp with time zone", false),
];

/// With `$1` the table (text, as for `regclass`) and `$2` the column names:
/// each column's type (NULL where there is none) and whether it is
/// `NOT NULL`, in their order; whether a unique index on exactly
/// `(source, event_id)` is in place; the relation's kind (a table, a view…);
/// and whether a B-tree index, which the pruner's range scan can use, leads
/// with `received_at`, whatever its name (a table renamed away keeps its
/// index's name). A missing table fails the cast.
const SHAPE: &str = "SELECT
       (SELECT array_agg(format_type(a.atttypid, a.atttypmod) ORDER BY c.ord)
          FROM unnest($2::text[]) WITH ORDINALITY AS c(name, ord)
          LEFT JOIN pg_attribute a
            ON a.attrelid = $1::regclass AND a.attname = c.name
           AND a.attnum > 0 AND NOT a.attisdropped),
       (SELECT array_agg(coalesce(a.attnotnull, false) ORDER BY c.ord)
          FROM unnest($2::text[]) WITH ORDINALITY AS c(name, ord)
          LEFT JOIN pg_attribute a
            ON a.attrelid = $1::regclass AND a.attname = c.name
           AND a.attnum > 0 AND NOT a.attisdropped),
       EXISTS (SELECT 1 FROM pg_index i
                WHERE i.indrelid = $1::regclass AND i.indisunique AND i.indisvalid
                  AND i.indpred IS NULL AND i.indexprs IS NULL AND i.indnkeyatts = 2
                  AND (SELECT array_agg(a.attname::text ORDER BY a.attname)
                         FROM pg_attribute a
                        WHERE a.attrelid = i.indrelid AND a.attnum IN (i.indkey[0], i.indkey[1]))
                      = ARRAY['event_id', 'source']),
       (SELECT relkind::text FROM pg_class WHERE oid = $1::regclass),
       EXISTS (SELECT 1 FROM pg_index i
                 JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
                 JOIN pg_class ic ON ic.oid = i.indexrelid
                 JOIN pg_am am ON am.oid = ic.relam
                WHERE i.indrelid = $1::regclass AND i.indisvalid AND i.indpred IS NULL
                  AND am.amname = 'btree' AND a.attname = 'received_at')";

/// What the catalog says of the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Shape {
    /// Each of [`CLAIMS_COLUMNS`]'s types, `None` for a missing column.
    types: Vec<Option<String>>,
    not_null: Vec<bool>,
    /// A unique index on `(source, event_id)`.
    keyed: bool,
    /// `pg_class.relkind`: `r` a table, `p` a partitioned one.
    kind: String,
    /// An index leads with `received_at`.
    pub(super) indexed: bool,
}

impl Shape {
    /// Reads the shape of `table` (as text for `regclass`).
    pub(super) async fn read(
        client: &impl tokio_postgres::GenericClient,
        table: &str,
    ) -> Result<Self, StoreError> {
        let columns: Vec<&str> = CLAIMS_COLUMNS.iter().map(|(name, ..)| *name).collect();
        let rows = client
            .query_typed(SHAPE, &[(&table, Type::TEXT), (&columns, Type::TEXT_ARRAY)])
            .await
            .map_err(postgres_error)?;
        let row = rows
            .first()
            .ok_or_else(|| StoreError::Postgres("the table's shape could not be read".into()))?;
        Ok(Self {
            types: row
                .try_get::<_, Option<Vec<Option<String>>>>(0)
                .map_err(postgres_error)?
                .unwrap_or_default(),
            not_null: row
                .try_get::<_, Option<Vec<bool>>>(1)
                .map_err(postgres_error)?
                .unwrap_or_default(),
            keyed: row.try_get(2).map_err(postgres_error)?,
            kind: row
                .try_get::<_, Option<String>>(3)
                .map_err(postgres_error)?
                .unwrap_or_default(),
            indexed: row.try_get(4).map_err(postgres_error)?,
        })
    }

    /// What keeps this table from being the claims table; `None` when
    /// nothing does. A missing `received_at` index does not: the migration
    /// makes one.
    pub(super) fn problem(&self) -> Option<String> {
        let not_a_table = match self.kind.as_str() {
            "r" | "p" => None,
            "v" => Some("a view"),
            "m" => Some("a materialized view"),
            "f" => Some("a foreign table"),
            _ => Some("not an ordinary table"),
        };
        if let Some(what) = not_a_table {
            return Some(format!("it is {what}"));
        }
        let mut problems: Vec<String> = CLAIMS_COLUMNS
            .iter()
            .zip(self.types.iter().zip(&self.not_null))
            .filter_map(
                |((name, wanted, wanted_not_null), (found, not_null))| match found {
                    None => Some(format!("no column {name}")),
                    Some(found) if found != wanted => {
                        Some(format!("column {name} is {found}, not {wanted}"))
                    }
                    Some(_) if *wanted_not_null && !not_null => Some(format!(
                        "column {name} may be NULL, where it must be NOT NULL"
                    )),
                    Some(_) => None,
                },
            )
            .collect();
        if !self.keyed {
            problems.push("no primary key or unique index on (source, event_id)".into());
        }
        (!problems.is_empty()).then(|| problems.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims_table() -> Shape {
        Shape {
            types: CLAIMS_COLUMNS
                .iter()
                .map(|(_, wanted, _)| Some((*wanted).to_owned()))
                .collect(),
            not_null: CLAIMS_COLUMNS
                .iter()
                .map(|(.., not_null)| *not_null)
                .collect(),
            keyed: true,
            kind: "r".into(),
            indexed: false,
        }
    }

    #[test]
    fn a_shape_problem_names_every_column_that_differs_and_a_missing_key() {
        let mut shape = claims_table();
        assert_eq!(shape.problem(), None, "an index can be made");
        shape.types[3] = Some("bigint".into());
        shape.types[9] = None;
        shape.not_null[6] = false;
        shape.not_null[4] = true;
        shape.keyed = false;
        assert_eq!(
            shape.problem().as_deref(),
            Some(
                "column attempts is bigint, not integer; \
                 column received_at may be NULL, where it must be NOT NULL; \
                 no column completed_at; \
                 no primary key or unique index on (source, event_id)"
            )
        );
    }

    #[test]
    fn only_a_table_can_be_the_claims_table() {
        for (kind, problem) in [
            ("p", None),
            ("v", Some("it is a view")),
            ("m", Some("it is a materialized view")),
            ("f", Some("it is a foreign table")),
            ("S", Some("it is not an ordinary table")),
        ] {
            let shape = Shape {
                kind: kind.into(),
                ..claims_table()
            };
            assert_eq!(shape.problem().as_deref(), problem, "{kind}");
        }
    }
}
