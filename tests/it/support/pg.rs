//! A database of its own for each test on the shared PostgreSQL at 127.0.0.1:5432 (trust
//! auth, user `postgres`, DESIGN §4), made at start and dropped (`WITH (FORCE)`) when the
//! guard goes. Queries go through `psql`, as an operator's would.

use std::process::Command;

use super::{require_tool, unique_id};

pub const PG_HOST: &str = "127.0.0.1";
pub const PG_PORT: u16 = 5432;

/// One test database.
pub struct TestDb {
    pub name: String,
}

fn psql(db: &str, sql: &str) -> Result<String, String> {
    let out = Command::new(require_tool("psql", "apt-get install postgresql-client"))
        .args([
            "-h",
            PG_HOST,
            "-p",
            &PG_PORT.to_string(),
            "-U",
            "postgres",
            "-d",
            db,
        ])
        .args(["-v", "ON_ERROR_STOP=1", "-X", "-q", "-A", "-t", "-c", sql])
        .output()
        .map_err(|e| format!("run psql: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim_end().to_string())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).to_string())
    }
}

impl TestDb {
    pub fn create(tag: &str) -> TestDb {
        let name = unique_id(&format!("cairn_{tag}")).replace('-', "_");
        if let Err(e) = psql("postgres", &format!("CREATE DATABASE {name}")) {
            panic!(
                "PostgreSQL at {PG_HOST}:{PG_PORT} (trust auth, user postgres) is needed: \
                 install it with `apt-get install postgresql` and start it; {e}"
            );
        }
        TestDb { name }
    }

    /// A URL for user `postgres`, through `port` (a proxy's, or 5432).
    pub fn url_via(&self, port: u16) -> String {
        format!("postgresql://postgres@{PG_HOST}:{port}/{}", self.name)
    }

    pub fn url(&self) -> String {
        self.url_via(PG_PORT)
    }

    /// Rows as lines, columns separated by `|`; panics on an SQL error.
    pub fn query(&self, sql: &str) -> String {
        psql(&self.name, sql).unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    pub fn try_query(&self, sql: &str) -> Result<String, String> {
        psql(&self.name, sql)
    }

    /// Terminate every other connection to this database (a database restart, as its
    /// clients see it); returns how many.
    pub fn terminate_backends(&self) -> usize {
        let n = psql(
            "postgres",
            &format!(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE datname = '{}' AND pid <> pg_backend_pid()",
                self.name
            ),
        )
        .unwrap_or_default();
        n.trim().parse().unwrap_or(0)
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let _ = psql(
            "postgres",
            &format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name),
        );
    }
}
