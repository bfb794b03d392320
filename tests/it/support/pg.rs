//! PostgreSQL for the tests. [`TestDb`]: a database of its own for each test on the shared
//! PostgreSQL at 127.0.0.1:5432 (trust auth, user `postgres`, DESIGN §4), made at start and
//! dropped (`WITH (FORCE)`) when the guard goes; that server is never stopped by a test.
//! [`PrivatePg`]: a whole server of a test's own, on a free loopback port, which the test
//! may crash and start again. Queries go through `psql`, as an operator's would, on a
//! [`PgConn`].

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::{free_port, require_tool, unique_id};

pub const PG_HOST: &str = "127.0.0.1";
pub const PG_PORT: u16 = 5432;

/// Where `psql` goes: a database on a server at 127.0.0.1, as user `postgres` (trust auth).
#[derive(Debug, Clone)]
pub struct PgConn {
    pub port: u16,
    pub db: String,
}

impl PgConn {
    /// Rows as lines, columns separated by `|`; panics on an SQL error.
    pub fn query(&self, sql: &str) -> String {
        self.try_query(sql).unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    pub fn try_query(&self, sql: &str) -> Result<String, String> {
        let out = Command::new(require_tool("psql", "apt-get install postgresql-client"))
            .args(["-h", PG_HOST, "-p", &self.port.to_string()])
            .args(["-U", "postgres", "-d", &self.db])
            .args(["-v", "ON_ERROR_STOP=1", "-X", "-q", "-A", "-t", "-c", sql])
            // Fail at once while the server is down rather than wait for it.
            .env("PGCONNECT_TIMEOUT", "5")
            .output()
            .map_err(|e| format!("run psql: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim_end().to_string())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).to_string())
        }
    }

    /// A URL for user `postgres`, through `port` (a proxy's, or the server's).
    pub fn url_via(&self, port: u16) -> String {
        format!("postgresql://postgres@{PG_HOST}:{port}/{}", self.db)
    }

    pub fn url(&self) -> String {
        self.url_via(self.port)
    }
}

/// A `psql` session kept open (its stdin held): what it ran, such as a `LOCK TABLE` in an
/// open transaction, holds until the server goes or the session is dropped (killed).
pub struct PgSession {
    child: std::process::Child,
}

impl PgConn {
    /// Runs `sql` in a session that stays open until the returned guard goes.
    pub fn session(&self, sql: &str) -> PgSession {
        use std::io::Write;
        let mut child = Command::new(require_tool("psql", "apt-get install postgresql-client"))
            .args(["-h", PG_HOST, "-p", &self.port.to_string()])
            .args(["-U", "postgres", "-d", &self.db])
            .args(["-v", "ON_ERROR_STOP=1", "-X", "-q"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("run psql: {e}"));
        let stdin = child.stdin.as_mut().expect("psql stdin");
        writeln!(stdin, "{sql}").expect("write to psql");
        stdin.flush().expect("write to psql");
        PgSession { child }
    }
}

impl Drop for PgSession {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One test database on the shared server.
pub struct TestDb {
    pub name: String,
}

fn shared(db: &str) -> PgConn {
    PgConn {
        port: PG_PORT,
        db: db.to_string(),
    }
}

impl TestDb {
    pub fn create(tag: &str) -> TestDb {
        let name = unique_id(&format!("cairn_{tag}")).replace('-', "_");
        if let Err(e) = shared("postgres").try_query(&format!("CREATE DATABASE {name}")) {
            panic!(
                "PostgreSQL at {PG_HOST}:{PG_PORT} (trust auth, user postgres) is needed: \
                 install it with `apt-get install postgresql` and start it; {e}"
            );
        }
        TestDb { name }
    }

    /// This database on the shared server, as a [`PgConn`] that outlives no guard.
    pub fn conn(&self) -> PgConn {
        shared(&self.name)
    }

    /// A URL for user `postgres`, through `port` (a proxy's, or 5432).
    pub fn url_via(&self, port: u16) -> String {
        self.conn().url_via(port)
    }

    pub fn url(&self) -> String {
        self.url_via(PG_PORT)
    }

    /// Rows as lines, columns separated by `|`; panics on an SQL error.
    pub fn query(&self, sql: &str) -> String {
        self.conn().query(sql)
    }

    pub fn try_query(&self, sql: &str) -> Result<String, String> {
        self.conn().try_query(sql)
    }

    /// Terminate every other connection to this database (a database restart, as its
    /// clients see it); returns how many.
    pub fn terminate_backends(&self) -> usize {
        let n = shared("postgres")
            .try_query(&format!(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE datname = '{}' AND pid <> pg_backend_pid()",
                self.name
            ))
            .unwrap_or_default();
        n.trim().parse().unwrap_or(0)
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let _ = shared("postgres").try_query(&format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        ));
    }
}

/// How long `pg_ctl start` may wait for the server to accept connections (WAL recovery
/// after a crash included).
const PG_START_TIMEOUT: Duration = Duration::from_secs(60);

/// A PostgreSQL server of one test's own: `initdb` into a temp dir, listening on
/// 127.0.0.1 only, on a free port, trust auth from 127.0.0.1 and the unix socket in the
/// temp dir only, `fsync = on`. The shared server at 5432 must never be restarted by a test;
/// this one is, with [`PrivatePg::crash_restart`]. PostgreSQL refuses to run as root: as
/// root, every server command runs as the `postgres` user (`runuser`), which owns the temp
/// dir. Dropped: stopped (`-m immediate`) and removed.
pub struct PrivatePg {
    pub port: u16,
    bin: PathBuf,
    dir: tempfile::TempDir,
    /// `runuser -u postgres --` before every server command when the tests run as root.
    as_postgres: bool,
}

/// The bin directory of the highest PostgreSQL version installed the Debian way.
fn server_bin() -> PathBuf {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            ["initdb", "pg_ctl", "postgres"]
                .iter()
                .all(|t| bin.join(t).is_file())
                .then_some((version, bin))
        })
        .collect();
    found.sort();
    match found.pop() {
        Some((_, bin)) => bin,
        None => panic!(
            "no PostgreSQL server binaries (/usr/lib/postgresql/<version>/bin/{{initdb,pg_ctl,\
             postgres}}): install them with `apt-get install postgresql`"
        ),
    }
}

/// `id -u NAME` / `id -g NAME`.
fn id_of(flag: &str, user: &str) -> u32 {
    let out = Command::new("id")
        .args([flag, user])
        .output()
        .unwrap_or_else(|e| panic!("run id: {e}"));
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|_| {
            panic!(
                "no `{user}` user to run PostgreSQL as (it refuses root): install the Debian \
                 package `postgresql`, which makes it"
            )
        })
}

impl PrivatePg {
    /// `initdb` and start; panics, saying why, when it cannot.
    pub fn start() -> PrivatePg {
        let bin = server_bin();
        let dir = tempfile::tempdir().expect("PostgreSQL temp dir");
        // The effective uid owns /proc/self.
        let as_postgres = std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0);
        if as_postgres {
            std::os::unix::fs::chown(
                dir.path(),
                Some(id_of("-u", "postgres")),
                Some(id_of("-g", "postgres")),
            )
            .expect("chown the PostgreSQL temp dir to postgres");
        }
        let pg = PrivatePg {
            port: free_port(),
            bin,
            dir,
            as_postgres,
        };
        let data = pg.data();
        let out = pg
            .server_command("initdb")
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8"])
            .args(["--locale=C"])
            .output()
            .expect("run initdb");
        assert!(
            out.status.success(),
            "initdb: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        // Trust from 127.0.0.1 and the private socket only; nothing else may connect.
        pg.write_as_owner(
            &data.join("pg_hba.conf"),
            "local all all trust\nhost all all 127.0.0.1/32 trust\n",
        );
        let conf = std::fs::read_to_string(data.join("postgresql.conf")).expect("postgresql.conf");
        pg.write_as_owner(
            &data.join("postgresql.conf"),
            &format!(
                "{conf}\n# cairn test server\nlisten_addresses = '127.0.0.1'\nport = {}\n\
                 unix_socket_directories = '{}'\nshared_buffers = 16MB\nmax_connections = 40\n\
                 fsync = on\nsynchronous_commit = on\nfull_page_writes = on\n\
                 logging_collector = off\n",
                pg.port,
                pg.dir.path().display()
            ),
        );
        pg.start_server();
        pg
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn log(&self) -> PathBuf {
        self.dir.path().join("server.log")
    }

    /// A server binary, run as `postgres` when we are root, from the temp dir (the user may
    /// not enter the test's working directory).
    fn server_command(&self, tool: &str) -> Command {
        let mut c = if self.as_postgres {
            let mut c = Command::new(require_tool("runuser", "apt-get install util-linux"));
            c.args(["-u", "postgres", "--"]).arg(self.bin.join(tool));
            c
        } else {
            Command::new(self.bin.join(tool))
        };
        c.current_dir(self.dir.path());
        c
    }

    /// Writes a file in the data dir, owned by the server's user.
    fn write_as_owner(&self, path: &Path, text: &str) {
        std::fs::write(path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        if self.as_postgres {
            std::os::unix::fs::chown(
                path,
                Some(id_of("-u", "postgres")),
                Some(id_of("-g", "postgres")),
            )
            .expect("chown to postgres");
        }
    }

    /// `pg_ctl stop`/`start`, with its output when it fails.
    fn pg_ctl(&self, args: &[&str]) -> Result<(), String> {
        let out = self
            .server_command("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .arg("-l")
            .arg(self.log())
            .args(args)
            .output()
            .map_err(|e| format!("run pg_ctl: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "pg_ctl {args:?}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    /// Starts the server and waits until it answers a query (after WAL recovery, if it
    /// crashed).
    pub fn start_server(&self) {
        let timeout = PG_START_TIMEOUT.as_secs().to_string();
        if let Err(e) = self.pg_ctl(&["-w", "-t", &timeout, "start"]) {
            panic!("{e}\nserver log:\n{}", self.log_tail(30));
        }
        let deadline = Instant::now() + PG_START_TIMEOUT;
        while let Err(e) = self.conn("postgres").try_query("SELECT 1") {
            assert!(
                Instant::now() < deadline,
                "the private PostgreSQL does not answer: {e}\n{}",
                self.log_tail(30)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A crash: `pg_ctl stop -m immediate` (every backend killed, nothing flushed beyond
    /// what was fsynced; the next start runs WAL recovery). Connections are refused until
    /// [`PrivatePg::start_server`].
    pub fn crash(&self) {
        if let Err(e) = self.pg_ctl(&["-w", "stop", "-m", "immediate"]) {
            panic!("{e}\nserver log:\n{}", self.log_tail(30));
        }
    }

    /// [`PrivatePg::crash`], `down` with the port closed, then start again (WAL recovery).
    pub fn crash_restart(&self, down: Duration) {
        self.crash();
        std::thread::sleep(down);
        self.start_server();
    }

    /// Database `db` on this server.
    pub fn conn(&self, db: &str) -> PgConn {
        PgConn {
            port: self.port,
            db: db.to_string(),
        }
    }

    /// Makes database `name` and returns it.
    pub fn create_db(&self, name: &str) -> PgConn {
        self.conn("postgres")
            .query(&format!("CREATE DATABASE {name}"));
        self.conn(name)
    }

    /// The last `n` lines of the server's log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(self.log()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// How many times the server has run crash recovery, from its log.
    pub fn recoveries(&self) -> usize {
        std::fs::read_to_string(self.log())
            .unwrap_or_default()
            .matches("database system was not properly shut down; automatic recovery in progress")
            .count()
    }
}

impl Drop for PrivatePg {
    fn drop(&mut self) {
        let _ = self.pg_ctl(&["-w", "stop", "-m", "immediate"]);
    }
}
