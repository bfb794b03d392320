//! The PostgreSQL sink (`kind = "postgres"`): one table per pipeline, `<table_prefix><pipeline>`,
//! and one progress table, `<table_prefix>progress`.
//!
//! **Guarantee.** After any crash, re-send or replay, each table holds what the pipeline's
//! results fold to: an `upsert` (or `final`) pipeline one row per (source, key[,
//! window_start]) with the highest (generation, version) sent, a `changelog` pipeline one
//! row per (source, id). A reader never sees a row's (generation, version) go back.
//!
//! **Mechanism.**
//! - Upsert rows: `INSERT .. ON CONFLICT (source, key[, window_start]) DO UPDATE .. WHERE
//!   (row.generation, row.version) < (new.generation, new.version)`: an older version is a
//!   no-op however late it comes. Within one batch only the newest result per row is sent
//!   (one statement may not update a row twice); the others are settled with it.
//! - Changelog rows: `INSERT .. ON CONFLICT (source, id) DO NOTHING`.
//! - One transaction per batch, which also sets `(source, sink) -> position` in the progress
//!   table: the batch and the position are committed together or not at all. A result is
//!   settled when the commit answers; a commit whose answer is lost is re-sent and changes
//!   nothing.
//! - A batch that fails as data (SQLSTATE class 22: a NUL jsonb or text cannot hold, a value
//!   out of range) is written again row by row under savepoints: the rows the database
//!   refuses are dead letters (`postgres_rejected`), the rest commit. Values bigint cannot
//!   hold (a version or window start above 2^63 - 1) are dead letters before any SQL
//!   (`postgres_out_of_range`).
//! - Tables are made at connect if missing (under an advisory lock, so agents of a fleet
//!   starting together do not race), and an existing table that does not fit (a column
//!   missing or of another type, no unique index on the conflict columns, a NOT NULL column
//!   Cairn does not fill) makes the sink refuse, naming the table and what is wrong.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, NoTls, Statement};

use super::{Destination, SinkError, SinkResult, Verdict};
use crate::config::TlsConfig;

/// `[[sink]] kind = "postgres"`.
#[derive(Debug, Clone, PartialEq)]
pub struct PostgresConfig {
    /// The sink's name: the progress table's `sink` column.
    pub name: String,
    pub url: String,
    pub password_file: Option<PathBuf>,
    pub tls: Option<TlsConfig>,
    /// This box's identity, written into every row.
    pub source: String,
    pub table_prefix: String,
}

/// A pipeline that feeds the sink, as its table needs to know it.
#[derive(Debug, Clone, PartialEq)]
pub struct PipelineTable {
    pub pipeline: String,
    pub windowed: bool,
    /// `changelog`: one row per result ID; otherwise one row per key (and window).
    pub changelog: bool,
}

/// PostgreSQL folds nothing in a quoted identifier but cuts it at 63 bytes.
pub const MAX_IDENTIFIER: usize = 63;

/// The table a pipeline's results go to.
pub fn table_name(prefix: &str, pipeline: &str) -> String {
    format!("{prefix}{pipeline}")
}

/// The progress table's name. A pipeline of that name is refused (`check_names`).
pub fn progress_table(prefix: &str) -> String {
    format!("{prefix}progress")
}

/// Config validation: every name fits in an identifier, and none is the progress table's.
pub fn check_names(prefix: &str, pipelines: &[PipelineTable]) -> Result<(), String> {
    let progress = progress_table(prefix);
    if progress.len() > MAX_IDENTIFIER {
        return Err(format!(
            "table_prefix `{prefix}` is too long: `{progress}` is over {MAX_IDENTIFIER} bytes"
        ));
    }
    for p in pipelines {
        let t = table_name(prefix, &p.pipeline);
        if t.len() > MAX_IDENTIFIER {
            return Err(format!(
                "table `{t}` for pipeline `{}` is over PostgreSQL's {MAX_IDENTIFIER} bytes: \
                 shorten table_prefix or the pipeline name",
                p.pipeline
            ));
        }
        if t == progress {
            return Err(format!(
                "pipeline `{}` would write into the progress table `{progress}`: rename it",
                p.pipeline
            ));
        }
    }
    Ok(())
}

impl PostgresConfig {
    /// What is wrong with the keys, as (key, problem), for config validation; `pipelines`
    /// are the ones that feed this sink.
    pub fn problems(&self, pipelines: &[PipelineTable]) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        if let Err(e) = tokio_postgres::Config::from_str(&self.url) {
            out.push(("url", format!("not a PostgreSQL URL: {e}")));
        }
        if let Err(e) = super::check_source(&self.source) {
            out.push(("source", e));
        }
        if !self
            .table_prefix
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_')
        {
            out.push((
                "table_prefix",
                format!(
                    "`{}` may hold only A-Z a-z 0-9 _",
                    self.table_prefix.escape_debug()
                ),
            ));
        } else if let Err(e) = check_names(&self.table_prefix, pipelines) {
            out.push(("table_prefix", e));
        }
        out
    }
}

fn quote(ident: &str) -> String {
    format!("\"{}\"", ident.replace('"', "\"\""))
}

/// One table: its pipeline's shape and its prepared statement.
struct Table {
    name: String,
    shape: PipelineTable,
    statement: Option<Statement>,
}

impl Table {
    /// The columns Cairn writes, with their types as `information_schema` names them.
    fn columns(&self) -> Vec<(&'static str, &'static str)> {
        let mut c = vec![("source", "text"), ("key", "text")];
        if self.shape.windowed {
            c.push(("window_start", "bigint"));
        }
        c.extend([
            ("generation", "bigint"),
            ("version", "bigint"),
            ("id", "text"),
            ("payload", "jsonb"),
        ]);
        c
    }

    /// The columns of the unique index the conflict clause names.
    fn conflict(&self) -> Vec<&'static str> {
        if self.shape.changelog {
            vec!["source", "id"]
        } else if self.shape.windowed {
            vec!["source", "key", "window_start"]
        } else {
            vec!["source", "key"]
        }
    }

    fn create_sql(&self) -> String {
        let cols: Vec<String> = self
            .columns()
            .iter()
            .map(|(n, t)| format!("{n} {t} NOT NULL"))
            .collect();
        format!(
            "CREATE TABLE IF NOT EXISTS {} ({}, PRIMARY KEY ({}))",
            quote(&self.name),
            cols.join(", "),
            self.conflict().join(", ")
        )
    }

    /// The batch statement: `$1` the source, then one array per column but the source.
    fn insert_sql(&self) -> String {
        let cols = self.columns();
        let names: Vec<&str> = cols.iter().map(|c| c.0).collect();
        let mut arrays = Vec::new();
        let mut select = vec!["$1".to_string()];
        for (i, (n, t)) in cols.iter().enumerate().skip(1) {
            let pg = if *t == "bigint" { "int8" } else { "text" };
            arrays.push(format!("${}::{pg}[]", i + 1));
            select.push(if *t == "jsonb" {
                format!("u.{n}::jsonb")
            } else {
                format!("u.{n}")
            });
        }
        let conflict = if self.shape.changelog {
            "ON CONFLICT (source, id) DO NOTHING".to_string()
        } else {
            format!(
                "ON CONFLICT ({}) DO UPDATE SET generation = EXCLUDED.generation, \
                 version = EXCLUDED.version, id = EXCLUDED.id, payload = EXCLUDED.payload \
                 WHERE (t.generation, t.version) < (EXCLUDED.generation, EXCLUDED.version)",
                self.conflict().join(", ")
            )
        };
        format!(
            "INSERT INTO {} AS t ({}) SELECT {} FROM unnest({}) AS u({}) {conflict}",
            quote(&self.name),
            names.join(", "),
            select.join(", "),
            arrays.join(", "),
            names[1..].join(", "),
        )
    }
}

/// The rows of one table in one statement, column by column.
#[derive(Default)]
struct Rows {
    key: Vec<String>,
    window_start: Vec<i64>,
    generation: Vec<i64>,
    version: Vec<i64>,
    id: Vec<String>,
    payload: Vec<String>,
}

impl Rows {
    fn push(&mut self, r: &Checked) {
        self.key.push(r.key.clone());
        if let Some(w) = r.window_start {
            self.window_start.push(w);
        }
        self.generation.push(r.generation);
        self.version.push(r.version);
        self.id.push(r.id.clone());
        self.payload.push(r.payload.clone());
    }

    fn params<'a>(&'a self, source: &'a String, windowed: bool) -> Vec<&'a (dyn ToSql + Sync)> {
        let mut p: Vec<&(dyn ToSql + Sync)> = vec![source, &self.key];
        if windowed {
            p.push(&self.window_start);
        }
        p.extend([
            &self.generation as &(dyn ToSql + Sync),
            &self.version,
            &self.id,
            &self.payload,
        ]);
        p
    }
}

/// A result whose values fit the columns.
struct Checked {
    table: usize,
    key: String,
    window_start: Option<i64>,
    generation: i64,
    version: i64,
    id: String,
    payload: String,
}

/// The PostgreSQL sink's client: one connection, its tables, its statements.
pub struct Postgres {
    cfg: PostgresConfig,
    tables: Vec<Table>,
    by_pipeline: HashMap<String, usize>,
    client: Option<Client>,
    progress: Option<Statement>,
    position: Option<u64>,
}

fn pg_error(what: &str, e: &tokio_postgres::Error) -> SinkError {
    let text = match e.as_db_error() {
        Some(db) => format!("{what}: {} ({})", db.message(), db.code().code()),
        None => format!("{what}: {e}"),
    };
    match e.code().map(|c| c.code()) {
        // Credentials, privileges, a database that is not there: an operator must act.
        Some(c) if c.starts_with("28") || c == "42501" || c == "3D000" => SinkError::Refused(text),
        _ => SinkError::Down(text),
    }
}

/// SQLSTATE class 22 (data exception): the database refuses a value, not the connection.
fn is_data_error(e: &tokio_postgres::Error) -> bool {
    e.code().is_some_and(|c| c.code().starts_with("22"))
}

impl Postgres {
    pub fn new(cfg: PostgresConfig, pipelines: &[PipelineTable]) -> Result<Postgres, String> {
        check_names(&cfg.table_prefix, pipelines)?;
        tokio_postgres::Config::from_str(&cfg.url).map_err(|e| format!("url: {e}"))?;
        let tables: Vec<Table> = pipelines
            .iter()
            .map(|p| Table {
                name: table_name(&cfg.table_prefix, &p.pipeline),
                shape: p.clone(),
                statement: None,
            })
            .collect();
        let by_pipeline = pipelines
            .iter()
            .enumerate()
            .map(|(i, p)| (p.pipeline.clone(), i))
            .collect();
        Ok(Postgres {
            cfg,
            tables,
            by_pipeline,
            client: None,
            progress: None,
            position: None,
        })
    }

    /// The position the progress table held for this sink at the last connect.
    pub fn position(&self) -> Option<u64> {
        self.position
    }

    async fn open(&self) -> Result<Client, SinkError> {
        let mut config = tokio_postgres::Config::from_str(&self.cfg.url)
            .map_err(|e| SinkError::Refused(format!("url: {e}")))?;
        if let Some(path) = &self.cfg.password_file {
            config.password(super::read_secret("password_file", path).map_err(SinkError::Refused)?);
        }
        config.connect_timeout(Duration::from_secs(10));
        let client = match &self.cfg.tls {
            Some(tls) => {
                let rustls = super::tls_client_config(tls).map_err(SinkError::Refused)?;
                config.ssl_mode(tokio_postgres::config::SslMode::Require);
                let tls = tokio_postgres_rustls::MakeRustlsConnect::new(rustls);
                let (client, conn) = config
                    .connect(tls)
                    .await
                    .map_err(|e| pg_error("connect", &e))?;
                tokio::spawn(async move {
                    let _ = conn.await;
                });
                client
            }
            None => {
                let (client, conn) = config
                    .connect(NoTls)
                    .await
                    .map_err(|e| pg_error("connect", &e))?;
                tokio::spawn(async move {
                    let _ = conn.await;
                });
                client
            }
        };
        Ok(client)
    }

    /// Make what is missing, refuse what does not fit, prepare the statements.
    async fn ensure(&mut self, client: &mut Client) -> Result<(), SinkError> {
        let progress = progress_table(&self.cfg.table_prefix);
        {
            let tx = client
                .transaction()
                .await
                .map_err(|e| pg_error("begin", &e))?;
            // One agent at a time creates tables: CREATE TABLE IF NOT EXISTS races with
            // itself (a unique violation on pg_type) when a fleet starts together.
            tx.execute("SELECT pg_advisory_xact_lock(7236052617357935)", &[])
                .await
                .map_err(|e| pg_error("lock", &e))?;
            tx.batch_execute(&format!(
                "CREATE TABLE IF NOT EXISTS {} (source text NOT NULL, sink text NOT NULL, \
                 position bigint NOT NULL, PRIMARY KEY (source, sink))",
                quote(&progress)
            ))
            .await
            .map_err(|e| pg_error(&format!("create {progress}"), &e))?;
            for t in &self.tables {
                tx.batch_execute(&t.create_sql())
                    .await
                    .map_err(|e| pg_error(&format!("create {}", t.name), &e))?;
            }
            tx.commit().await.map_err(|e| pg_error("commit", &e))?;
        }
        let mut problems = Vec::new();
        problems.extend(
            fits(
                client,
                &progress,
                &[("source", "text"), ("sink", "text"), ("position", "bigint")],
                &["sink", "source"],
            )
            .await?,
        );
        for t in &self.tables {
            let mut conflict = t.conflict();
            conflict.sort_unstable();
            problems.extend(fits(client, &t.name, &t.columns(), &conflict).await?);
        }
        if !problems.is_empty() {
            return Err(SinkError::Refused(format!(
                "existing tables do not fit (drop or rename them, or change table_prefix): {}",
                problems.join("; ")
            )));
        }
        for t in &mut self.tables {
            t.statement = Some(
                client
                    .prepare(&t.insert_sql())
                    .await
                    .map_err(|e| pg_error(&format!("prepare for {}", t.name), &e))?,
            );
        }
        self.progress = Some(
            client
                .prepare(&format!(
                    "INSERT INTO {} (source, sink, position) VALUES ($1, $2, $3) \
                     ON CONFLICT (source, sink) DO UPDATE SET position = EXCLUDED.position",
                    quote(&progress)
                ))
                .await
                .map_err(|e| pg_error("prepare progress", &e))?,
        );
        let row = client
            .query_opt(
                &format!(
                    "SELECT position FROM {} WHERE source = $1 AND sink = $2",
                    quote(&progress)
                ),
                &[&self.cfg.source, &self.cfg.name],
            )
            .await
            .map_err(|e| pg_error("read progress", &e))?;
        self.position = row.and_then(|r| u64::try_from(r.get::<_, i64>(0)).ok());
        Ok(())
    }

    /// Values the columns cannot hold are dead letters before any SQL.
    fn check(&self, r: &SinkResult) -> Result<Checked, Verdict> {
        let refuse = |reason, detail: String| Verdict::DeadLetter { reason, detail };
        let Some(&table) = self.by_pipeline.get(&r.pipeline) else {
            return Err(refuse(
                "postgres_no_table",
                format!("pipeline `{}` has no table in this sink", r.pipeline),
            ));
        };
        let big = |what: &str, v: u64| {
            i64::try_from(v).map_err(|_| {
                refuse(
                    "postgres_out_of_range",
                    format!("{what} {v} is over bigint's 9223372036854775807"),
                )
            })
        };
        let window_start = match (self.tables[table].shape.windowed, r.window_start) {
            (true, Some(w)) => Some(big("window_start", w)?),
            (true, None) => {
                return Err(refuse(
                    "postgres_no_table",
                    format!("result {} has no window_start for a windowed table", r.id),
                ));
            }
            (false, _) => None,
        };
        let payload = String::from_utf8(r.payload.clone())
            .map_err(|_| refuse("postgres_rejected", "the result is not UTF-8".to_string()))?;
        Ok(Checked {
            table,
            key: r.key.clone(),
            window_start,
            generation: i64::from(r.generation),
            version: big("version", r.version)?,
            id: r.id.clone(),
            payload,
        })
    }
}

/// What is wrong with table `name` against the columns and conflict index Cairn needs.
async fn fits(
    client: &Client,
    name: &str,
    columns: &[(&str, &str)],
    conflict_sorted: &[&str],
) -> Result<Vec<String>, SinkError> {
    let rows = client
        .query(
            "SELECT column_name::text, data_type::text, is_nullable::text = 'YES', \
             column_default IS NOT NULL OR is_generated <> 'NEVER' OR is_identity = 'YES' \
             FROM information_schema.columns \
             WHERE table_schema = current_schema() AND table_name = $1",
            &[&name],
        )
        .await
        .map_err(|e| pg_error("read columns", &e))?;
    let have: BTreeMap<String, (String, bool)> = rows
        .iter()
        .map(|r| {
            let fillable: bool = r.get::<_, bool>(2) || r.get::<_, bool>(3);
            (r.get::<_, String>(0), (r.get::<_, String>(1), fillable))
        })
        .collect();
    let mut problems = Vec::new();
    for (col, ty) in columns {
        match have.get(*col) {
            None => problems.push(format!("{name}: no column `{col}` ({ty})")),
            Some((t, _)) if t != ty => {
                problems.push(format!("{name}: column `{col}` is {t}, not {ty}"))
            }
            Some(_) => {}
        }
    }
    for (col, (_, fillable)) in &have {
        if !fillable && !columns.iter().any(|(c, _)| c == col) {
            problems.push(format!(
                "{name}: column `{col}` is NOT NULL without a default, and Cairn does not fill it"
            ));
        }
    }
    let unique = client
        .query(
            "SELECT array_agg(a.attname::text ORDER BY a.attname::text) \
             FROM pg_index i JOIN pg_attribute a \
               ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) \
             WHERE i.indrelid = to_regclass($1) AND i.indisunique AND i.indpred IS NULL \
             GROUP BY i.indexrelid",
            &[&quote(name)],
        )
        .await
        .map_err(|e| pg_error("read indexes", &e))?;
    let has_index = unique
        .iter()
        .any(|r| r.get::<_, Vec<String>>(0) == conflict_sorted);
    if !has_index {
        problems.push(format!(
            "{name}: no unique index on ({}) alone",
            conflict_sorted.join(", ")
        ));
    }
    Ok(problems)
}

impl Destination for Postgres {
    async fn connect(&mut self) -> Result<String, SinkError> {
        self.client = None;
        let mut client = self.open().await?;
        self.ensure(&mut client).await?;
        self.client = Some(client);
        let names: Vec<&str> = self.tables.iter().map(|t| t.name.as_str()).collect();
        Ok(format!(
            "tables {} and {}; settled position {}",
            names.join(", "),
            progress_table(&self.cfg.table_prefix),
            self.position.map_or("none".into(), |p| p.to_string())
        ))
    }

    async fn deliver(
        &mut self,
        batch: &[SinkResult],
        position: u64,
    ) -> Result<Vec<Verdict>, SinkError> {
        let mut verdicts = vec![Verdict::Settled; batch.len()];
        let mut rows: Vec<(usize, Checked)> = Vec::with_capacity(batch.len());
        for (i, r) in batch.iter().enumerate() {
            match self.check(r) {
                Ok(c) => rows.push((i, c)),
                Err(v) => verdicts[i] = v,
            }
        }
        // Per upsert row, only the newest result of the batch: the rest are settled with it.
        let mut newest: HashMap<(usize, &str, Option<i64>), usize> = HashMap::new();
        for (k, (_, c)) in rows.iter().enumerate() {
            if self.tables[c.table].shape.changelog {
                continue;
            }
            let slot = newest
                .entry((c.table, c.key.as_str(), c.window_start))
                .or_insert(k);
            let cur = &rows[*slot].1;
            if (c.generation, c.version) > (cur.generation, cur.version) {
                *slot = k;
            }
        }
        let keep: Vec<bool> = rows
            .iter()
            .enumerate()
            .map(|(k, (_, c))| {
                self.tables[c.table].shape.changelog
                    || newest.get(&(c.table, c.key.as_str(), c.window_start)) == Some(&k)
            })
            .collect();
        let position = i64::try_from(position).unwrap_or(i64::MAX);
        let Some(client) = self.client.as_mut() else {
            return Err(SinkError::Down("not connected".into()));
        };
        let progress = self.progress.clone().expect("prepared at connect");
        let source = self.cfg.source.clone();
        let sink = self.cfg.name.clone();
        // First the whole batch as one statement per table.
        let whole = {
            let tx = client
                .transaction()
                .await
                .map_err(|e| pg_error("begin", &e))?;
            let mut failed = None;
            for (t, table) in self.tables.iter().enumerate() {
                let mut r = Rows::default();
                for ((_, c), keep) in rows.iter().zip(&keep) {
                    if c.table == t && *keep {
                        r.push(c);
                    }
                }
                if r.id.is_empty() {
                    continue;
                }
                let st = table.statement.as_ref().expect("prepared at connect");
                if let Err(e) = tx
                    .execute(st, &r.params(&source, table.shape.windowed))
                    .await
                {
                    failed = Some(e);
                    break;
                }
            }
            match failed {
                Some(e) => Err(e),
                None => match tx.execute(&progress, &[&source, &sink, &position]).await {
                    Ok(_) => tx.commit().await,
                    Err(e) => Err(e),
                },
            }
        };
        match whole {
            Ok(()) => return Ok(verdicts),
            Err(e) if is_data_error(&e) => {}
            Err(e) => {
                if e.code().is_some_and(|c| c.code().starts_with("40")) {
                    // Serialization failure or deadlock: nothing landed, try again.
                    return Ok(vec![Verdict::Retry; batch.len()]);
                }
                return Err(pg_error("write", &e));
            }
        }
        // A value the database refuses: row by row, each under a savepoint.
        let mut tx = client
            .transaction()
            .await
            .map_err(|e| pg_error("begin", &e))?;
        for ((i, c), keep) in rows.iter().zip(&keep) {
            if !*keep {
                continue;
            }
            let table = &self.tables[c.table];
            let mut r = Rows::default();
            r.push(c);
            let st = table.statement.as_ref().expect("prepared at connect");
            let sp = tx
                .savepoint("cairn_row")
                .await
                .map_err(|e| pg_error("savepoint", &e))?;
            match sp
                .execute(st, &r.params(&source, table.shape.windowed))
                .await
            {
                Ok(_) => sp.commit().await.map_err(|e| pg_error("release", &e))?,
                Err(e) if is_data_error(&e) => {
                    sp.rollback().await.map_err(|e| pg_error("rollback", &e))?;
                    let detail = e
                        .as_db_error()
                        .map_or(e.to_string(), |d| d.message().to_string());
                    // Rows of the batch that this one stood for (older versions of its
                    // key) go with it: they were never going to be written.
                    for (j, (_, o)) in rows.iter().enumerate() {
                        let same = !table.shape.changelog
                            && o.table == c.table
                            && o.key == c.key
                            && o.window_start == c.window_start;
                        if same || rows[j].0 == *i {
                            verdicts[rows[j].0] = Verdict::DeadLetter {
                                reason: "postgres_rejected",
                                detail: detail.clone(),
                            };
                        }
                    }
                }
                Err(e) => return Err(pg_error("write", &e)),
            }
        }
        tx.execute(&progress, &[&source, &sink, &position])
            .await
            .map_err(|e| pg_error("write progress", &e))?;
        tx.commit().await.map_err(|e| pg_error("commit", &e))?;
        Ok(verdicts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(windowed: bool, changelog: bool) -> Table {
        Table {
            name: "cairn_p".into(),
            shape: PipelineTable {
                pipeline: "p".into(),
                windowed,
                changelog,
            },
            statement: None,
        }
    }

    #[test]
    fn the_upsert_statement_writes_only_a_newer_generation_and_version() {
        let sql = table(true, false).insert_sql();
        assert!(
            sql.contains("ON CONFLICT (source, key, window_start) DO UPDATE"),
            "{sql}"
        );
        assert!(
            sql.contains(
                "WHERE (t.generation, t.version) < (EXCLUDED.generation, EXCLUDED.version)"
            ),
            "{sql}"
        );
        assert!(
            sql.contains(
                "unnest($2::text[], $3::int8[], $4::int8[], $5::int8[], $6::text[], $7::text[])"
            ),
            "{sql}"
        );
        let sql = table(false, true).insert_sql();
        assert!(
            sql.ends_with("ON CONFLICT (source, id) DO NOTHING"),
            "{sql}"
        );
        assert!(!sql.contains("window_start"), "{sql}");
    }

    #[test]
    fn names_too_long_for_postgres_or_the_progress_tables_are_refused() {
        let p = |name: &str| PipelineTable {
            pipeline: name.into(),
            windowed: false,
            changelog: false,
        };
        assert!(check_names("cairn_", &[p("balances")]).is_ok());
        assert!(
            check_names("cairn_", &[p("progress")])
                .unwrap_err()
                .contains("progress table")
        );
        assert!(
            check_names("cairn_", &[p(&"x".repeat(58))])
                .unwrap_err()
                .contains("63")
        );
        assert_eq!(quote("a\"b"), "\"a\"\"b\"");
    }

    #[test]
    fn config_problems_name_their_key() {
        let cfg = PostgresConfig {
            name: "w".into(),
            url: "postgresql://cairn@db:5432/telemetry".into(),
            password_file: None,
            tls: None,
            source: "box-17".into(),
            table_prefix: "cairn_".into(),
        };
        assert!(cfg.problems(&[]).is_empty());
        let bad = PostgresConfig {
            url: "postgresql://db:notaport/x".into(),
            source: "a/b".into(),
            table_prefix: "cairn-".into(),
            ..cfg
        };
        let keys: Vec<&str> = bad.problems(&[]).iter().map(|p| p.0).collect();
        assert_eq!(keys, ["url", "source", "table_prefix"]);
    }
}
