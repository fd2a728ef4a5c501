#!/usr/bin/python3
"""The dedupe-proxy benchmark (started by bench/run; see bench/README.md).

Starts everything it measures on loopback (nginx as the upstream, nginx as a
plain reverse proxy, dedupe-proxy on PostgreSQL and on SQLite), runs bounded
loads with wrk and pgbench side by side, interleaved (A, B, A, B, ...), at
several concurrencies and repetitions, checks every answer, and reports
medians and paired ratios as a table, JSON, CSV and a plot.

Python standard library only (matplotlib for the plot when installed).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import hashlib
import json
import os
import platform
import random
import re
import resource
import shlex
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
LUA = BENCH / "wrk" / "webhook.lua"
PAYLOAD = BENCH / "payload.json"
# pgbench's keys, the same shapes as bench/wrk/webhook.lua's: 18 digits, nonce
# (6) + client (3) + per-client counter (9) for first deliveries; one of the
# `keys` pre-populated done keys, nonce + 999 + index, for duplicates.
PGBENCH_KEYS = {
    "unique": "\\set n :n + 1\n\\set key :nonce * 1000000000000 + :client_id * 1000000000 + :n\n",
    "cycle": "\\set i random(0, :keys - 1)\n\\set key :nonce * 1000000000000 + 999 * 1000000000 + :i\n",
}
# The proxy's parameters, in order, as pgbench variables.
# The last is the guard's: the process's instance, also written into the text.
PGBENCH_PARAMS = {"claim_one": ["source", "key", "sha", "lease_ms", "reject_mismatch", "instance"],
                  "settle_one": ["source", "key", "claim_attempt", "claim_claimed_at", "status",
                                 "response_status", "instance"]}
INSTANCE = "0123456789abcdef"
# The least a claim can be: the INSERT alone, which on an existing key
# conflicts and returns nothing. It cannot tell a done key from one to take
# back or one in flight, so no claim could be just this; it is the floor the
# duplicates are measured against.
BARE_INSERT = ("INSERT INTO processed_events (source, event_id, status, attempts, payload_sha256, "
               "lease_expires_at) VALUES (:source, :key, 'processing', 1, :sha, "
               "now() + :lease_ms * interval '1 millisecond') "
               "ON CONFLICT (source, event_id) DO NOTHING RETURNING attempts;\n")
# Each pgbench scenario's keys and statements.
# The claim's answer as pgbench variables (`claim_attempt`, `claim_claimed_at`,
# …), for the settle behind it: its fence is the claim's attempt and time.
CLAIM_ANSWER = "\\gset claim_\n"
PGBENCH_SCRIPTS = {"pgbench-first": ["claim_one_answered", "settle_one"], "pgbench-dup": ["claim_one"],
                   "pgbench-insert": ["bare_insert"]}

# Where the proxy's claim and settle statements are.
STATEMENTS = "src/store/postgres/sql.rs"
ROUTE = "orders"
ROUTE_PATH = "/hooks/orders"
UNMATCHED_PATH = "/hooks/unrouted"
BACKGROUND_PREFIX = "000000"  # run nonces are 100000..999999: no collision
LEASE_MS = 300_000
PG_MARGIN = 10  # connection slots left to other users of the server  # store.lease default (5m), as the proxy sends it
HZ = os.sysconf("SC_CLK_TCK")


class BenchError(Exception):
    """A failure that makes the run's numbers meaningless."""


def pgbench_statements():
    """The proxy's statements for a batch of one, as pgbench scripts' lines,
    read from src/store/postgres/sql.rs with their fragments filled in."""
    source = (ROOT / STATEMENTS).read_text()
    # The statements share SQL fragments, each made by a closure of
    # string parameters (`let takeable = |row: &str, …| format!("…")`)
    # and named by a `let` that calls it (`let prior_takeable =
    # takeable("p", …);`). The guard's closure also writes in the
    # process's instance.
    fragments = {"table": "processed_events"}
    closures = re.findall(r"let (\w+) = \|([\w\s:&,]*)\|\s*\{?\s*format!\(\s*\"(.*?)\"\s*\)", source, re.S)
    if not closures:
        raise BenchError(f"no SQL fragment closures in {STATEMENTS}")
    for closure, parameters, template in closures:
        names = [p.split(":")[0].strip() for p in parameters.split(",") if p.strip()]
        for name, arguments in re.findall(rf"let (\w+) = {closure}\((.*?)\);", source):
            values = re.findall(r'"(.*?)"', arguments)
            if len(values) != len(names):
                raise BenchError(f"`{name}` in {STATEMENTS}: cannot read the arguments of {closure}")
            fragment = template.replace("{instance}", INSTANCE)
            for parameter, value in zip(names, values):
                fragment = fragment.replace(f"{{{parameter}}}", value)
            fragments[name] = fragment
    statements = {}
    for name, params in PGBENCH_PARAMS.items():
        m = re.search(rf"\b{name}: format!\(\s*\"(.*?)\"\s*\)", source, re.S)
        if not m:
            raise BenchError(f"no `{name}` statement in {STATEMENTS}")
        sql = re.sub(r"\{(\w+)\}", lambda f: fragments.get(f.group(1), f.group(0)), m.group(1))
        if re.search(r"\{\w*\}", sql):
            raise BenchError(f"`{name}` in {STATEMENTS} uses a fragment the benchmark cannot fill in: {sql}")
        for i, var in reversed(list(enumerate(params, 1))):
            sql = sql.replace(f"${i}", f":{var}")
        statements[name] = " ".join(sql.split()) + ";\n"
    return statements


# --------------------------------------------------------------------------
# Scenarios


@dataclass(frozen=True)
class Scenario:
    name: str
    group: str  # runs of one group are interleaved with each other
    tool: str  # wrk | pgbench
    target: str  # proxy-pg | proxy-sqlite | nginx-proxy | nginx-direct | postgres
    mode: str  # unique | cycle
    expect: str  # the only answer accepted: "<status> <X-Dedupe-Outcome>"
    title: str


SCENARIOS = [
    Scenario("pg-first", "first", "wrk", "proxy-pg", "unique", "200 forwarded",
             "dedupe-proxy/PostgreSQL, first deliveries"),
    Scenario("pgbench-first", "first", "pgbench", "postgres", "unique", "",
             "pgbench claim + settle (2 transactions)"),
    Scenario("pg-dup", "dup", "wrk", "proxy-pg", "cycle", "200 duplicate",
             "dedupe-proxy/PostgreSQL, duplicates"),
    Scenario("pgbench-dup", "dup", "pgbench", "postgres", "cycle", "",
             "pgbench claim on a done key"),
    Scenario("pgbench-insert", "dup", "pgbench", "postgres", "cycle", "",
             "pgbench bare INSERT … ON CONFLICT DO NOTHING on a done key"),
    Scenario("proxy-pass", "pass", "wrk", "proxy-pg", "unique", "200 passthrough",
             "dedupe-proxy, unmatched pass-through"),
    Scenario("nginx-proxy", "pass", "wrk", "nginx-proxy", "unique", "200 none",
             "nginx proxy_pass (keep-alive upstream)"),
    Scenario("nginx-direct", "pass", "wrk", "nginx-direct", "unique", "200 none",
             "nginx return 200, direct"),
    Scenario("sqlite-first", "sqlite", "wrk", "proxy-sqlite", "unique", "200 forwarded",
             "dedupe-proxy/SQLite, first deliveries"),
    Scenario("sqlite-dup", "sqlite", "wrk", "proxy-sqlite", "cycle", "200 duplicate",
             "dedupe-proxy/SQLite, duplicates"),
]
BY_NAME = {s.name: s for s in SCENARIOS}
GROUPS = ["first", "dup", "pass", "sqlite"]

# (numerator, denominator, what it answers); per repetition, then the median.
RATIOS = [
    ("pg-first", "pgbench-first", "first deliveries vs the database's limit"),
    ("pg-dup", "pgbench-insert", "duplicates vs the bare duplicate INSERT"),
    ("pg-dup", "pgbench-dup", "duplicates vs the proxy's claim statement, one per event"),
    ("proxy-pass", "nginx-proxy", "pass-through vs a plain reverse proxy"),
    ("proxy-pass", "nginx-direct", "pass-through vs the upstream alone"),
    ("nginx-proxy", "nginx-direct", "plain reverse proxy vs the upstream alone"),
    ("pg-first", "nginx-direct", "first deliveries vs the upstream alone"),
    ("sqlite-first", "pg-first", "SQLite vs PostgreSQL, first deliveries"),
    ("sqlite-dup", "pg-dup", "SQLite vs PostgreSQL, duplicates"),
]
# The ratio shown next to each scenario in the main table.
BASELINE = {
    "pg-first": "pgbench-first",
    "pg-dup": "pgbench-insert",
    "proxy-pass": "nginx-proxy",
    "nginx-proxy": "nginx-direct",
    "sqlite-first": "pg-first",
    "sqlite-dup": "pg-dup",
}


# --------------------------------------------------------------------------
# Settings


def env(name, default):
    return os.environ.get(name, default)


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="bench/run",
        description="Benchmark dedupe-proxy against nginx and pgbench baselines.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--reps", type=int, default=int(env("BENCH_REPS", "5")),
                   help="repetitions of every scenario (BENCH_REPS)")
    p.add_argument("--duration", type=float, default=float(env("BENCH_DURATION", "6")),
                   help="seconds per load run (BENCH_DURATION)")
    p.add_argument("--concurrency", default=env("BENCH_CONCURRENCY", "16,64,256"),
                   help="comma-separated connection counts (BENCH_CONCURRENCY)")
    p.add_argument("--groups", default=env("BENCH_GROUPS", ",".join(GROUPS)),
                   help="scenario groups to run: first,dup,pass,sqlite (BENCH_GROUPS)")
    p.add_argument("--threads", type=int, default=int(env("BENCH_THREADS", "2")),
                   help="wrk -t and pgbench -j (BENCH_THREADS)")
    p.add_argument("--pool-size", type=int, default=int(env("BENCH_POOL_SIZE", "16")),
                   help="the proxy's store.pool_size (BENCH_POOL_SIZE)")
    p.add_argument("--keys", type=int, default=int(env("BENCH_KEYS", "10000")),
                   help="pre-populated done keys for duplicate runs (BENCH_KEYS)")
    p.add_argument("--table-rows", type=int, default=int(env("BENCH_TABLE_ROWS", "100000")),
                   help="done keys already in the table when a run starts, as in a proxy's "
                        "table in steady state (BENCH_TABLE_ROWS)")
    p.add_argument("--pg-host", default=env("BENCH_PG_HOST", "127.0.0.1"),
                   help="PostgreSQL host, or a socket directory such as /var/run/postgresql "
                        "(BENCH_PG_HOST); the proxy and pgbench both use it.")
    p.add_argument("--pg-port", type=int, default=int(env("BENCH_PG_PORT", "5432")),
                   help="(BENCH_PG_PORT)")
    p.add_argument("--pg-user", default=env("BENCH_PG_USER", "postgres"),
                   help="a superuser: the harness truncates, checkpoints and reads pg_stat_activity "
                        "(BENCH_PG_USER)")
    p.add_argument("--pg-db", default=env("BENCH_PG_DB", "dedupe_bench"),
                   help="benchmark database, created if missing (BENCH_PG_DB)")
    p.add_argument("--log-level", default=env("BENCH_LOG_LEVEL", "info"),
                   help="the proxy's log_level; nginx proxy_pass writes its access log "
                        "only at debug/trace, where the proxy logs unmatched requests too "
                        "(BENCH_LOG_LEVEL)")
    p.add_argument("--nginx-workers", default=env("BENCH_NGINX_WORKERS", "auto"),
                   help="worker_processes of both nginx instances (BENCH_NGINX_WORKERS)")
    p.add_argument("--warmup", type=float, default=float(env("BENCH_WARMUP", "2")),
                   help="seconds of unrecorded load per target before the runs (BENCH_WARMUP)")
    p.add_argument("--idle-connections", type=int,
                   default=int(env("BENCH_IDLE_CONNECTIONS", "1000")),
                   help="keep-alive connections for the idle RSS measurement, 0 to skip "
                        "(BENCH_IDLE_CONNECTIONS)")
    p.add_argument("--quick", action="store_true",
                   help="1 repetition of 2 s at 16 and 64, 1 s warm-up: checks the harness, "
                        "its numbers mean little")
    p.add_argument("--profile", choices=["callgrind", "perf"], default=None,
                   help="instead of the benchmark, profile the proxy under --profile-scenario: "
                        "callgrind (instructions, user space) or perf (cpu-clock samples, all processes)")
    p.add_argument("--profile-scenario", choices=["pg-first", "pg-dup", "proxy-pass"],
                   default=env("BENCH_PROFILE_SCENARIO", "pg-first"),
                   help="the load the proxy is profiled under (BENCH_PROFILE_SCENARIO)")
    p.add_argument("--check-statements", action="store_true",
                   help="print the pgbench scripts' statements read from the proxy's source, "
                        "and fail if one cannot be read; runs nothing")
    p.add_argument("--report", metavar="JSON", default=None,
                   help="print the report of a saved run (bench/results/bench-*.json) again, "
                        "and redraw its plot; runs nothing")
    p.add_argument("--profile-seconds", type=float,
                   default=float(env("BENCH_PROFILE_SECONDS", "20")),
                   help="load duration under the profiler (BENCH_PROFILE_SECONDS)")
    p.add_argument("--proxy-bin", default=env("BENCH_PROXY_BIN", str(ROOT / "target/release/dedupe-proxy")),
                   help="the binary to measure (bench/run passes the one it built)")
    p.add_argument("--results", default=env("BENCH_RESULTS", str(BENCH / "results")),
                   help="where JSON, CSV, plots and profiles go (BENCH_RESULTS)")
    a = p.parse_args(argv)
    if a.quick:
        a.reps, a.duration, a.warmup = 1, 2.0, 1.0
        if "BENCH_CONCURRENCY" not in os.environ and "--concurrency" not in " ".join(argv):
            a.concurrency = "16,64"
    a.concurrency = [int(c) for c in str(a.concurrency).split(",") if c.strip()]
    a.groups = [g.strip() for g in a.groups.split(",") if g.strip()]
    unknown = set(a.groups) - set(GROUPS)
    if unknown:
        p.error(f"unknown groups: {', '.join(sorted(unknown))}")
    if a.reps < 1 or a.duration < 1 or not a.concurrency:
        p.error("need --reps >= 1, --duration >= 1 and at least one concurrency")
    return a


# --------------------------------------------------------------------------
# Processes: everything started is registered and stopped on any exit.


class Processes:
    def __init__(self):
        self.live: list[tuple[str, subprocess.Popen]] = []

    def start(self, name, argv, log=None, env=None, **kw):
        out = open(log, "ab") if log else subprocess.DEVNULL
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True, **kw)
        self.live.append((name, proc))
        return proc

    def stop(self, proc, sig=signal.SIGTERM, timeout=15):
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=5)
        self._forget(proc)

    def _forget(self, proc):
        self.live = [(n, p) for n, p in self.live if p is not proc]

    def stop_all(self):
        for _, proc in reversed(list(self.live)):
            self.stop(proc, timeout=10)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url, timeout, proc=None, want=200):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BenchError(f"{url}: the process exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == want:
                    return
                last = r.status
        except urllib.error.HTTPError as e:
            last = e.code
        except OSError as e:
            last = e
        time.sleep(0.1)
    raise BenchError(f"{url} not ready within {timeout}s (last: {last})")


def http_get(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


# --------------------------------------------------------------------------
# PostgreSQL


class Postgres:
    def __init__(self, a):
        self.host, self.port, self.user, self.db = a.pg_host, a.pg_port, a.pg_user, a.pg_db
        self.unix = self.host.startswith("/")
        self.env = os.environ | {"PGSSLMODE": "disable", "PGAPPNAME": "dedupe-bench"}

    def server_args(self):
        return ["-h", self.host, "-p", str(self.port), "-U", self.user]

    def conn_args(self, db=None):
        """Where psql connects."""
        return [*self.server_args(), "-d", db or self.db]

    def pgbench_conn_args(self):
        """Where pgbench connects. Not conn_args: pgbench's `-d` is --debug,
        which logs every command it runs to stderr (38 MB in 5 s at 16
        clients) and halved its rate; the database is its last argument."""
        return [*self.server_args(), self.db]

    def url(self):
        """The proxy's store URL: the same transport as psql and pgbench."""
        if self.unix:
            return f"postgresql://{self.user}@/{self.db}?host={self.host}&port={self.port}&sslmode=disable"
        return f"postgres://{self.user}@{self.host}:{self.port}/{self.db}?sslmode=disable"

    def transport(self):
        return f"unix socket {self.host}" if self.unix else f"TCP {self.host}:{self.port}, sslmode=disable"

    def sql(self, statement, db=None, stdin=None):
        argv = ["psql", "-X", "-q", "-At", "-v", "ON_ERROR_STOP=1", *self.conn_args(db), "-c", statement]
        r = subprocess.run(argv, input=stdin, capture_output=True, text=True, env=self.env, timeout=300)
        if r.returncode != 0:
            raise BenchError(f"psql failed: {statement[:80]}...: {r.stderr.strip()}")
        return r.stdout.strip()

    def ensure_database(self):
        exists = self.sql(f"SELECT 1 FROM pg_database WHERE datname = '{self.db}'", db="postgres")
        if exists != "1":
            self.sql(f'CREATE DATABASE "{self.db}"', db="postgres")

    def connection_slots(self):
        """Connections non-superusers may open, and how many are open now."""
        out = self.sql(
            "SELECT current_setting('max_connections')::int"
            " - current_setting('superuser_reserved_connections')::int,"
            " (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')")
        slots, used = (int(x) for x in out.split("|"))
        return slots, used

    def reset(self, background, keys=None):
        """Empties the table (a new relation: no bloat from earlier runs) and
        fills it as a proxy's table looks in steady state: `background` done
        keys received over the last 7 days, plus the scenario's own `done`
        keys. Then VACUUM ANALYZE, so the planner sees a populated table and
        every run plans the same, and a checkpoint, so every run starts
        from the same WAL state. (ANALYZE of an empty table makes cached
        generic plans scan the table sequentially as it grows.)"""
        self.sql("TRUNCATE processed_events")
        self.sql("INSERT INTO processed_events (source, event_id, status, attempts, payload_sha256,"
                 " response_status, received_at, claimed_at, completed_at)"
                 f" SELECT '{ROUTE}', '{BACKGROUND_PREFIX}' || lpad(i::text, 12, '0'), 'done', 1,"
                 " sha256(i::text::bytea), 200, t, t, t"
                 f" FROM generate_series(1, {int(background)}) i,"
                 " LATERAL (SELECT now() - (i % 604800) * interval '1 second' AS t) lag")
        if keys:
            now = dt.datetime.now(dt.timezone.utc).isoformat()
            rows = "".join(f"{ROUTE}\t{k}\tdone\t1\t\\\\x{sha}\t200\t{now}\n" for k, sha in keys)
            self.sql("COPY processed_events (source, event_id, status, attempts, payload_sha256,"
                     " response_status, completed_at) FROM STDIN", stdin=rows)
        self.sql("VACUUM ANALYZE processed_events")
        self.sql("CHECKPOINT")

    def counts(self):
        """The scenario's rows (not the background)."""
        out = self.sql("SELECT count(*) FILTER (WHERE status = 'done'),"
                       " count(*) FILTER (WHERE status = 'processing'),"
                       " count(*) FILTER (WHERE status = 'failed'),"
                       " coalesce(max(attempts), 0) FROM processed_events"
                       f" WHERE event_id NOT LIKE '{BACKGROUND_PREFIX}%'")
        done, processing, failed, attempts = (int(x) for x in out.split("|"))
        return {"done": done, "processing": processing, "failed": failed, "max_attempts": attempts}


# --------------------------------------------------------------------------
# The payload and keys: one template for wrk, pgbench and pre-population.


def payload_parts():
    text = PAYLOAD.read_text().strip()
    prefix, sep, suffix = text.partition("{{EVENT_ID}}")
    if not sep:
        raise BenchError(f"{PAYLOAD} has no {{{{EVENT_ID}}}} placeholder")
    return prefix, suffix


def cycle_keys(nonce, n):
    """The pre-populated keys, as webhook.lua's cycle mode sends them."""
    prefix, suffix = payload_parts()
    keys = []
    for i in range(n):
        key = f"{nonce:06d}999{i:09d}"
        keys.append((key, hashlib.sha256((prefix + key + suffix).encode()).hexdigest()))
    return keys


# --------------------------------------------------------------------------
# Configuration files


def nginx_conf(prefix: Path, port: int, workers: str, access_log: bool, upstream_port: int | None):
    temp = "\n".join(f"  {d}_temp_path {prefix}/{d};" for d in
                     ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    if upstream_port is None:
        body = """
    location / {
      return 200;
    }"""
        upstream = ""
    else:
        upstream = f"""
  upstream app {{
    server 127.0.0.1:{upstream_port};
    keepalive 512;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
  }}"""
        body = """
    location / {
      proxy_pass http://app;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header Host $http_host;
      proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
      proxy_set_header X-Forwarded-Proto $scheme;
      proxy_set_header X-Forwarded-Host $host;
    }"""
    log = f"access_log {prefix}/access.log;" if access_log else "access_log off;"
    return f"""worker_processes {workers};
worker_rlimit_nofile 16384;
daemon off;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{
  worker_connections 8192;
}}
http {{
  {log}
{temp}
  keepalive_requests 1000000;
  keepalive_timeout 300s;
{upstream}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
{body}
  }}
}}
"""


def proxy_conf(port, admin_port, upstream_port, store_url, pool_size, log_level):
    return f"""# Written by bench/bench.py: one header-keyed route in front of nginx.
listen: 127.0.0.1:{port}
admin_listen: 127.0.0.1:{admin_port}
upstream:
  url: http://127.0.0.1:{upstream_port}
store:
  url: "{store_url}"
  pool_size: {pool_size}
log_level: {log_level}
shutdown_grace: 5s
routes:
  - name: {ROUTE}
    path: {ROUTE_PATH}
    key: {{ header: X-Event-Id }}
"""


# --------------------------------------------------------------------------
# Sampling CPU and memory while a load runs


def read_stat(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return None
    comm_end = raw.rfind(")")
    fields = raw[comm_end + 2:].split()
    # fields[0] is state (field 3); ppid is field 4, utime 14, stime 15.
    return int(fields[1]), int(fields[11]) + int(fields[12])


def read_cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def vm_kib(pid, field_name):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def machine_busy():
    """Busy and interrupt ticks of the whole machine (iowait counts as idle)."""
    with open("/proc/stat") as f:
        values = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = values
    return user + nice + system + irq + softirq + steal, irq + softirq


class Sampler(threading.Thread):
    """Per-component CPU (in cores) and the proxy's peak RSS during one run.

    Components: the proxy, PostgreSQL (this database's backends and the
    server's own processes), nginx (both instances), the load generator
    (wrk or pgbench), interrupts (softirq: the loopback network stack) and
    everything else on the machine ("other": other work sharing it, and
    this harness)."""

    def __init__(self, roles: dict[int, str], postmaster: int | None, db: str, rss_pid: int | None,
                 interval=0.5):
        super().__init__(daemon=True)
        self.roles, self.postmaster, self.db, self.rss_pid = roles, postmaster, db, rss_pid
        self.interval = interval
        self.stop_event = threading.Event()
        self.first: dict[int, int] = {}
        self.last: dict[int, tuple[str, int]] = {}
        self.rss_max = 0
        self.pg_class: dict[int, str] = {}

    def classify(self, pid, ppid):
        role = self.roles.get(pid) or self.roles.get(ppid)
        if role:
            return role
        if self.postmaster and (pid == self.postmaster or ppid == self.postmaster):
            if pid not in self.pg_class:
                title = read_cmdline(pid)
                client = re.search(r"\d+\.\d+\.\d+\.\d+\(\d+\)|\[local\]", title)
                self.pg_class[pid] = "postgres" if (f" {self.db} " in title or not client) else None
            return self.pg_class[pid]
        return None

    def sample(self, initial=False):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            stat = read_stat(pid)
            if stat is None:
                continue
            role = self.classify(pid, stat[0])
            if role is None:
                continue
            if initial:
                self.first[pid] = stat[1]
            self.first.setdefault(pid, 0)  # started during the run
            self.last[pid] = (role, stat[1])
        if self.rss_pid:
            rss = vm_kib(self.rss_pid, "VmRSS") or 0
            self.rss_max = max(self.rss_max, rss)

    def run(self):
        while not self.stop_event.wait(self.interval):
            self.sample()

    def __enter__(self):
        (self.busy0, self.irq0), self.t0 = machine_busy(), time.monotonic()
        self.sample(initial=True)
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop_event.set()
        self.join()
        self.sample()
        elapsed = time.monotonic() - self.t0
        busy, irq = machine_busy()
        busy, irq = (busy - self.busy0) / HZ, (irq - self.irq0) / HZ
        cores = {}
        for pid, (role, ticks) in self.last.items():
            cores[role] = cores.get(role, 0.0) + (ticks - self.first.get(pid, 0)) / HZ
        # Interrupt time (on loopback: mostly the network stack's softirqs)
        # belongs to no process.
        cores["irq"] = irq
        cores["other"] = max(0.0, busy - sum(cores.values()))
        self.cores = {k: round(v / elapsed, 3) for k, v in cores.items()}
        self.cores["machine"] = round(busy / elapsed, 3)


# --------------------------------------------------------------------------
# The benchmark


@dataclass
class Run:
    scenario: str
    concurrency: int
    rep: int
    order: int
    rps: float = 0.0
    requests: int = 0
    seconds: float = 0.0
    p50_ms: float = 0.0
    p90_ms: float = 0.0
    p99_ms: float = 0.0
    clients: int = 0
    answers: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)
    cpu_cores: dict = field(default_factory=dict)
    rss_max_kib: int | None = None
    # Mean time a request spent in its claim (queued for a batch, the batch
    # at the database, the answer back), from the proxy's own histogram.
    claim_ms: float | None = None
    checks: dict = field(default_factory=dict)


class Bench:
    def __init__(self, a):
        self.a = a
        self.procs = Processes()
        self.pg = Postgres(a)
        self.tmp = Path(tempfile.mkdtemp(prefix="dedupe-bench-"))
        self.runs: list[Run] = []
        self.notes: list[str] = []
        # nginx proxy_pass only takes the pass-through load, and the proxy logs
        # unmatched requests at debug: a log line on one side only would make
        # the baseline do work the proxy does not.
        self.access_log = a.log_level.lower() in ("debug", "trace")
        self.started = dt.datetime.now(dt.timezone.utc)
        self.stamp = self.started.strftime("%Y%m%dT%H%M%SZ")
        self.rss = {}

    # ---- start-up

    def start_nginx(self, name, upstream_port=None):
        prefix = self.tmp / name
        prefix.mkdir()
        port = free_port()
        conf = prefix / "nginx.conf"
        conf.write_text(nginx_conf(prefix, port, self.a.nginx_workers,
                                   self.access_log and upstream_port is not None, upstream_port))
        proc = self.procs.start(name, ["nginx", "-p", str(prefix), "-c", str(conf)],
                                log=prefix / "stderr.log")
        deadline = time.monotonic() + 10
        while True:
            if proc.poll() is not None:
                raise BenchError(f"{name} exited: {(prefix / 'error.log').read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise BenchError(f"{name} not listening on {port}")
                time.sleep(0.05)
        return proc, port, prefix

    def start_proxy(self, name, store_url, wrapper=()):
        port, admin = free_port(), free_port()
        conf = self.tmp / f"{name}.yaml"
        conf.write_text(proxy_conf(port, admin, self.upstream_port, store_url,
                                   self.a.pool_size, self.a.log_level))
        log = self.tmp / f"{name}.log"
        log.write_bytes(b"")
        proc = self.procs.start(name, [*wrapper, self.a.proxy_bin, "--config", str(conf)], log=log)
        wait_http(f"http://127.0.0.1:{admin}/readyz", 120 if wrapper else 20, proc)
        return Proxy(name, proc, port, admin, log, conf)

    def setup(self):
        if not Path(self.a.proxy_bin).is_file():
            raise BenchError(f"no proxy binary at {self.a.proxy_bin} (bench/run builds it)")
        for tool in ("wrk", "nginx", "pgbench", "psql"):
            if not shutil.which(tool):
                raise BenchError(f"{tool} is not installed (bench/run installs it with apt-get)")
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))
        self.pg.ensure_database()
        self.postmaster = self.find_postmaster()
        self.upstream, self.upstream_port, _ = self.start_nginx("nginx-upstream")
        self.nginx_proxy, self.nginx_proxy_port, self.nginx_proxy_prefix = self.start_nginx(
            "nginx-proxy", self.upstream_port)
        self.proxy_pg = self.start_proxy("proxy-pg", self.pg.url())
        self.sqlite_path = self.tmp / "dedupe.db"
        self.proxy_sqlite = self.start_proxy("proxy-sqlite", f"sqlite://{self.sqlite_path}")
        self.write_pgbench_scripts()

    def find_postmaster(self):
        try:
            pid = int(self.pg.sql("SELECT pid FROM pg_stat_activity WHERE backend_type = 'checkpointer'"))
            return read_stat(pid)[0]
        except (ValueError, TypeError, BenchError):
            self.notes.append("PostgreSQL's processes were not found: its CPU counts as other")
            return None

    def write_pgbench_scripts(self):
        """The pgbench baselines run the proxy's own statements for a batch of
        one, read from src/store/postgres/sql.rs: a first delivery is the claim
        then the settle, a duplicate the claim alone; and, for duplicates, the
        bare INSERT."""
        statements = pgbench_statements()
        statements["bare_insert"] = BARE_INSERT
        statements["claim_one_answered"] = statements["claim_one"].removesuffix(";\n") + "\n" + CLAIM_ANSWER
        self.pgbench_scripts = {}
        for name, parts in PGBENCH_SCRIPTS.items():
            path = self.tmp / f"{name}.sql"
            path.write_text(PGBENCH_KEYS[BY_NAME[name].mode] + "".join(statements[n] for n in parts))
            self.pgbench_scripts[name] = path

    # ---- one run

    def target_url(self, target, path):
        port = {"proxy-pg": lambda: self.proxy_pg.port, "proxy-sqlite": lambda: self.proxy_sqlite.port,
                "nginx-proxy": lambda: self.nginx_proxy_port,
                "nginx-direct": lambda: self.upstream_port}[target]()
        return f"http://127.0.0.1:{port}{path}"

    def roles(self, scenario, load_pid=None):
        roles = {self.proxy_pg.proc.pid: "proxy", self.proxy_sqlite.proc.pid: "proxy",
                 self.upstream.pid: "nginx", self.nginx_proxy.pid: "nginx"}
        if load_pid:
            roles[load_pid] = "client"
        return roles

    def prepare(self, s: Scenario, nonce):
        """Puts the store in the state the scenario starts from."""
        if s.group in ("first", "dup"):
            self.pg.reset(self.a.table_rows, cycle_keys(nonce, self.a.keys) if s.mode == "cycle" else None)
        elif s.group == "sqlite":
            self.sqlite_reset(cycle_keys(nonce, self.a.keys) if s.mode == "cycle" else None)
        for proxy in (self.proxy_pg, self.proxy_sqlite):
            proxy.log.write_bytes(b"")
        if self.access_log:
            (self.nginx_proxy_prefix / "access.log").write_bytes(b"")
        time.sleep(0.5)

    def sqlite_reset(self, keys=None):
        """As Postgres.reset: background rows, the scenario's keys, then
        checkpoint and VACUUM."""
        db = sqlite3.connect(self.sqlite_path, timeout=10, isolation_level=None)
        try:
            now = int(time.time() * 1000)
            db.execute("BEGIN")
            db.execute("DELETE FROM processed_events")
            db.execute(
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?)"
                " INSERT INTO processed_events (source, event_id, status, attempts, payload_sha256,"
                " response_status, received_at, claimed_at, completed_at)"
                " SELECT ?, ? || printf('%012d', i), 'done', 1, randomblob(32), 200,"
                " ? - (i % 604800) * 1000, ? - (i % 604800) * 1000, ? - (i % 604800) * 1000 FROM n",
                (self.a.table_rows, ROUTE, BACKGROUND_PREFIX, now, now, now))
            if keys:
                db.executemany(
                    "INSERT INTO processed_events (source, event_id, status, attempts, payload_sha256,"
                    " response_status, received_at, claimed_at, completed_at)"
                    " VALUES (?, ?, 'done', 1, ?, 200, ?, ?, ?)",
                    [(ROUTE, k, bytes.fromhex(sha), now, now, now) for k, sha in keys])
            db.execute("COMMIT")
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            db.execute("VACUUM")
            db.execute("ANALYZE")
        finally:
            db.close()

    def sqlite_counts(self):
        db = sqlite3.connect(self.sqlite_path, timeout=10)
        try:
            row = db.execute(
                "SELECT count(*) FILTER (WHERE status = 'done'), count(*) FILTER (WHERE status = 'processing'),"
                " count(*) FILTER (WHERE status = 'failed'), coalesce(max(attempts), 0) FROM processed_events"
                " WHERE event_id NOT LIKE ? || '%'", (BACKGROUND_PREFIX,)
            ).fetchone()
        finally:
            db.close()
        return dict(zip(("done", "processing", "failed", "max_attempts"), row))

    def run_one(self, s: Scenario, c: int, rep: int, order: int, record=True, duration=None):
        duration = duration or self.a.duration
        proxy = {"proxy-pg": self.proxy_pg, "proxy-sqlite": self.proxy_sqlite}.get(s.target)
        for attempt in range(1, 7):
            nonce = random.randint(100000, 999999)
            self.prepare(s, nonce)
            run = Run(s.name, c, rep, order)
            before = proxy.metrics() if proxy else None
            if s.tool == "wrk":
                self.run_wrk(s, c, nonce, duration, run, proxy)
            elif not self.run_pgbench(s, c, nonce, duration, run, retry=attempt < 6):
                continue
            break
        after = proxy.metrics() if proxy else None
        if proxy:
            run.claim_ms = mean_claim_ms(before, after)
        self.verify(s, c, run, proxy, before, after)
        if record:
            self.runs.append(run)
        return run

    def run_wrk(self, s, c, nonce, duration, run, proxy):
        prefix, suffix = payload_parts()
        threads = min(self.a.threads, c)
        path = UNMATCHED_PATH if s.group == "pass" else ROUTE_PATH
        env = os.environ | {
            "BENCH_MODE": s.mode, "BENCH_NONCE": str(nonce), "BENCH_KEYS": str(self.a.keys),
            "BENCH_THREADS": str(threads), "BENCH_PATH": path,
            "BENCH_BODY_PREFIX": prefix, "BENCH_BODY_SUFFIX": suffix,
        }
        argv = ["wrk", "-t", str(threads), "-c", str(c), "-d", f"{duration:g}s", "--timeout", "10s",
                "-s", str(LUA), self.target_url(s.target, path)]
        load = LoadCommand(self.procs, "wrk", argv, env, timeout=duration + 60)
        with Sampler(self.roles(s), self.postmaster, self.pg.db,
                     proxy.proc.pid if proxy else None) as sampler:
            load.start(sampler)
            rc, out, err = load.wait()
        if rc != 0:
            raise BenchError(f"wrk exited {rc}: {err.strip()[-1000:]}")
        line = next((l for l in out.splitlines() if l.startswith("BENCH-RESULT ")), None)
        if line is None:
            raise BenchError(f"wrk printed no result: {out[-1000:]} {err[-1000:]}")
        r = json.loads(line.removeprefix("BENCH-RESULT "))
        run.requests = r["requests"]
        run.seconds = r["duration_us"] / 1e6
        run.rps = run.requests / run.seconds if run.seconds else 0.0
        run.p50_ms, run.p90_ms, run.p99_ms = (r["latency_us"][k] / 1000 for k in ("p50", "p90", "p99"))
        run.answers, run.errors, run.clients = r["answers"], r["errors"], c
        run.cpu_cores, run.rss_max_kib = sampler.cores, sampler.rss_max if proxy else None

    def run_pgbench(self, s, c, nonce, duration, run, retry):
        clients = min(c, self.pg_client_cap)
        script = self.pgbench_scripts[s.name]
        sha = hashlib.sha256(b"pgbench payload").hexdigest()
        logdir = self.tmp / "pgbench-log"
        shutil.rmtree(logdir, ignore_errors=True)
        logdir.mkdir()
        variables = {"nonce": nonce, "n": 0, "keys": self.a.keys, "source": ROUTE, "sha": "\\x" + sha,
                     "lease_ms": LEASE_MS, "reject_mismatch": "false", "status": "done", "response_status": 200,
                     "instance": INSTANCE}
        argv = ["pgbench", "-n", "-M", "prepared", "-f", str(script), "-c", str(clients),
                "-j", str(min(self.a.threads, clients)), "-T", str(max(1, round(duration))),
                "--log", f"--log-prefix={logdir}/tx", *self.pg.pgbench_conn_args()]
        for k, v in variables.items():
            argv[1:1] = ["-D", f"{k}={v}"]
        load = LoadCommand(self.procs, "pgbench", argv, self.pg.env, timeout=duration + 60)
        with Sampler(self.roles(s), self.postmaster, self.pg.db, None) as sampler:
            load.start(sampler)
            rc, out, err = load.wait()
        if rc != 0 and ("connection slots" in err or "too many clients" in err) and retry:
            # Other users of the server hold slots for a moment: wait, retry.
            slots, used = self.pg.connection_slots()
            print(f"  pgbench: no connection slots for {clients} clients ({used} of {slots} in use);"
                  " retrying in 5 s", flush=True)
            time.sleep(5)
            return False
        if rc != 0:
            raise BenchError(f"pgbench exited {rc}: {err.strip()[-1500:]}")
        processed = re.search(r"number of transactions actually processed: (\d+)", out)
        failed = re.search(r"number of failed transactions: (\d+)", out)
        tps = re.search(r"tps = ([\d.]+) \(without initial connection time\)", out)
        if not (processed and tps):
            raise BenchError(f"cannot read pgbench's output: {out[-1500:]}")
        latencies = []
        for f in logdir.iterdir():
            with open(f) as fh:
                latencies.extend(int(line.split()[2]) for line in fh if line.strip())
        latencies.sort()
        run.requests = int(processed.group(1))
        run.rps = float(tps.group(1))
        run.seconds = run.requests / run.rps if run.rps else 0.0
        run.p50_ms, run.p90_ms, run.p99_ms = (percentile(latencies, q) / 1000 for q in (50, 90, 99))
        run.clients = clients
        run.errors = {"failed": int(failed.group(1)) if failed else 0}
        run.answers = {"transactions": run.requests, "logged": len(latencies)}
        run.cpu_cores = sampler.cores
        shutil.rmtree(logdir, ignore_errors=True)
        return True

    # ---- checks: a benchmark of error responses is worthless

    def verify(self, s: Scenario, c, run: Run, proxy, before, after):
        problems = self.check_answers(s, run)
        if s.group in ("first", "dup", "sqlite"):
            problems += self.check_store(s, run)
        if proxy:
            problems += self.check_proxy(s, run, proxy, before, after)
        if problems:
            raise BenchError(f"{s.name} at {c} connections (rep {run.rep}): " + "; ".join(problems))

    def check_answers(self, s, run):
        """What the load generator saw: only the scenario's answer."""
        problems = []
        if run.requests <= 0:
            problems.append("no requests completed")
        if s.tool == "wrk":
            unexpected = {k: v for k, v in run.answers.items() if k != s.expect}
            if unexpected:
                problems.append(f"answers other than '{s.expect}': {unexpected}")
            socket_errors = {k: v for k, v in run.errors.items() if v and k != "status"}
            if socket_errors:
                problems.append(f"socket errors: {socket_errors}")
            answered = run.answers.get(s.expect, 0)
            if answered < run.requests:
                problems.append(f"only {answered} of {run.requests} answers were '{s.expect}'")
        else:
            if run.errors.get("failed"):
                problems.append(f"{run.errors['failed']} failed transactions")
            if run.answers["logged"] < run.requests:
                problems.append("pgbench's log misses transactions")
        return problems

    def check_store(self, s, run):
        """What the table says: every first delivery done once; the
        pre-populated keys untouched by duplicates."""
        problems = []
        counts = run.checks = self.settled_counts(s, run)
        if s.mode == "unique":
            if counts["failed"] or counts["max_attempts"] > 1:
                problems.append(f"rows failed or retried: {counts}")
            # wrk hangs up on its outstanding requests when time is up; a
            # claim cut off that way stays `processing` until its lease ends.
            if s.tool == "wrk" and (counts["done"] < run.requests or counts["processing"] > run.clients):
                problems.append(f"table has {counts} after {run.requests} forwarded requests")
            if s.tool == "pgbench" and (counts["done"] < run.requests
                                        or counts["processing"] > run.clients):
                problems.append(f"table has {counts} after {run.requests} transactions")
        elif counts != {"done": self.a.keys, "processing": 0, "failed": 0, "max_attempts": 1}:
            problems.append(f"the pre-populated keys changed: {counts}")
        return problems

    def check_proxy(self, s, run, proxy, before, after):
        """What the proxy counted and logged: only the expected outcome, no
        payload mismatches, no warnings."""
        problems = []
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        outcome = s.expect.split()[1]
        route = "unmatched" if s.group == "pass" else ROUTE
        requests = {k: v for k, v in delta.items() if k.startswith("dedupe_requests_total") and v}
        others = {k: v for k, v in requests.items() if f'outcome="{outcome}"' not in k}
        if others:
            problems.append(f"the proxy counted other outcomes: {others}")
        wanted = sum(v for k, v in requests.items()
                     if f'outcome="{outcome}"' in k and f'route="{route}"' in k)
        if wanted < run.answers.get(s.expect, 0):
            problems.append(f"the proxy counted {wanted:.0f} '{outcome}', wrk saw more")
        mismatches = sum(v for k, v in delta.items() if k.startswith("dedupe_payload_mismatch_total"))
        if mismatches:
            problems.append(f"{mismatches:.0f} payload mismatches (pre-populated hashes are wrong)")
        lines = strip_ansi(proxy.log.read_text(errors="replace")).splitlines()
        warnings = [l for l in lines if " WARN " in l or " ERROR " in l]
        if warnings:
            problems.append(f"{len(warnings)} warnings in the proxy's log, e.g. {warnings[0][:300]}")
        return problems

    def settled_counts(self, s, run):
        """The table's state once the claims open when the load stopped have
        settled (the proxy finishes a won claim even when its sender hung
        up; pgbench may leave its last claims unsettled)."""
        counts_of = self.sqlite_counts if s.group == "sqlite" else self.pg.counts
        deadline = time.monotonic() + 15
        counts, stable_since = counts_of(), time.monotonic()
        while s.tool == "wrk" and counts["processing"] and time.monotonic() < deadline:
            time.sleep(0.25)
            now = counts_of()
            if now != counts:
                counts, stable_since = now, time.monotonic()
            elif time.monotonic() - stable_since > 1.0:
                break
        return counts

    # ---- memory

    def measure_idle_rss(self):
        """Peak RSS of a fresh proxy holding N idle keep-alive connections,
        each of which has delivered one webhook (a won claim, forwarded)."""
        n = self.a.idle_connections
        if n <= 0:
            return
        proxy = self.proxy_pg
        self.pg.reset(self.a.table_rows)
        start_rss = vm_kib(proxy.proc.pid, "VmRSS")
        prefix, suffix = payload_parts()
        nonce = random.randint(100000, 999999)
        sockets = []
        try:
            for i in range(n):
                sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
                key = f"{nonce:06d}888{i:09d}"
                body = (prefix + key + suffix).encode()
                sock.sendall(
                    f"POST {ROUTE_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    f"X-Event-Id: {key}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
                status = read_response(sock)
                if status != 200:
                    raise BenchError(f"idle-connection setup: webhook answered {status}")
                sockets.append(sock)
            time.sleep(1.0)
            alive = sum(1 for s in sockets if s.fileno() >= 0)
            self.rss["idle"] = {
                "connections": alive,
                "rss_before_kib": start_rss,
                "vm_rss_kib": vm_kib(proxy.proc.pid, "VmRSS"),
                "vm_hwm_kib": vm_kib(proxy.proc.pid, "VmHWM"),
            }
        finally:
            for sock in sockets:
                sock.close()
        # A fresh process for the loads, so VmHWM afterwards is the load's peak.
        self.procs.stop(proxy.proc)
        self.proxy_pg = self.start_proxy("proxy-pg", self.pg.url())

    # ---- the whole run

    def plan(self):
        """Repetition, concurrency, group; inside a group the order rotates
        from one repetition and concurrency to the next."""
        plan = []
        for rep in range(1, self.a.reps + 1):
            for ci, c in enumerate(self.a.concurrency):
                for group in [g for g in GROUPS if g in self.a.groups]:
                    members = [s for s in SCENARIOS if s.group == group]
                    shift = (rep - 1 + ci) % len(members)
                    plan.extend((s, c, rep) for s in members[shift:] + members[:shift])
        return plan

    def warm_up(self):
        if self.a.warmup <= 0:
            return
        c = max(self.a.concurrency)
        seen = set()
        for s in SCENARIOS:
            if s.tool != "wrk" or s.group not in self.a.groups or (s.target, s.mode) in seen:
                continue
            seen.add((s.target, s.mode))
            self.run_one(s, c, 0, 0, record=False, duration=self.a.warmup)

    def main(self):
        self.setup()
        # pgbench gets the server's connections minus the proxy's pool and a
        # margin for other users of the server (and this harness's psql).
        slots, _ = self.pg.connection_slots()
        self.pg_client_cap = max(1, slots - self.a.pool_size - PG_MARGIN)
        if self.pg_client_cap < max(self.a.concurrency):
            self.notes.append(
                f"pgbench runs at most {self.pg_client_cap} clients: {slots} connection slots, minus the "
                f"proxy's pool of {self.a.pool_size}, minus {PG_MARGIN} for other users")
        self.print_header()
        if self.a.profile:
            return self.profile()
        if "first" in self.a.groups or "dup" in self.a.groups:
            print(f"measuring RSS with {self.a.idle_connections} idle keep-alive connections...", flush=True)
            self.measure_idle_rss()
        print(f"warming up ({self.a.warmup:g} s per target)...", flush=True)
        self.warm_up()
        print("running:", flush=True)
        plan = self.plan()
        t0 = time.monotonic()
        for i, (s, c, rep) in enumerate(plan, 1):
            run = self.run_one(s, c, rep, i)
            eta = (time.monotonic() - t0) / i * (len(plan) - i)
            print(f"  [{i:3d}/{len(plan)}] rep {rep} c={c:<4d} {s.name:<14s} {run.rps:10.0f} req/s"
                  f"  p50 {run.p50_ms:7.2f} ms  p99 {run.p99_ms:7.2f} ms"
                  f"{'  clients=' + str(run.clients) if run.clients != c else ''}"
                  f"   (eta {eta / 60:4.1f} min)", flush=True)
        self.rss["load"] = self.load_rss()
        report = Report(self)
        report.print()
        report.save()

    def load_rss(self):
        by_c = {}
        for r in self.runs:
            if r.rss_max_kib and BY_NAME[r.scenario].target == "proxy-pg":
                by_c[r.concurrency] = max(by_c.get(r.concurrency, 0), r.rss_max_kib)
        return {"sampled_max_vm_rss_kib_by_concurrency": by_c,
                "vm_hwm_kib": vm_kib(self.proxy_pg.proc.pid, "VmHWM"),
                "sqlite_vm_hwm_kib": vm_kib(self.proxy_sqlite.proc.pid, "VmHWM")}

    def print_header(self):
        self.machine = machine_facts(self.pg, self.a.proxy_bin)
        print_facts(command_line(), self.machine, self.settings(), self.notes)

    def settings(self):
        a = self.a
        return {"reps": a.reps, "duration_s": a.duration, "concurrency": a.concurrency,
                "groups": a.groups, "wrk_threads": a.threads, "pgbench_threads": a.threads,
                "pool_size": a.pool_size, "dup_keys": a.keys, "table_rows": a.table_rows, "pg_transport": self.pg.transport(),
                "pgbench_max_clients": self.pg_client_cap, "proxy_log_level": a.log_level,
                "nginx_access_log": self.access_log, "nginx_workers": a.nginx_workers,
                "payload_bytes": len(PAYLOAD.read_text().strip()) - len("{{EVENT_ID}}") + 18,
                "warmup_s": a.warmup}

    # ---- profile

    def profile(self):
        out = Path(self.a.results)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"profile-{self.a.profile}-{self.stamp}.txt"
        text = self.profile_callgrind() if self.a.profile == "callgrind" else self.profile_perf()
        facts = self.machine
        text = f"dedupe-proxy {facts['dedupe-proxy']}\non {facts['cpu']}, {facts['nproc']} CPUs\n{text}"
        path.write_text(text)
        print(text)
        print(f"\nprofile: {path}")

    def profile_callgrind(self):
        """The PostgreSQL proxy under callgrind, first deliveries at 16
        connections (or --profile-scenario): instructions per function, user
        space only."""
        data = self.tmp / "callgrind.out"
        self.procs.stop(self.proxy_pg.proc)
        self.proxy_pg = self.start_proxy("proxy-pg", self.pg.url(), wrapper=(
            "valgrind", "--tool=callgrind", f"--callgrind-out-file={data}"))
        scenario = self.a.profile_scenario
        run = self.run_one(BY_NAME[scenario], 16, 1, 1, record=False, duration=self.a.profile_seconds)
        self.procs.stop(self.proxy_pg.proc, timeout=120)
        # Kept beside the summary for callgrind_annotate --tree=caller etc.
        kept = Path(self.a.results) / f"callgrind-{self.stamp}.out"
        shutil.copyfile(data, kept)
        parts = [f"callgrind: {scenario} at 16 connections for {self.a.profile_seconds:g} s: "
                 f"{run.requests} requests ({run.rps:.0f} req/s under valgrind); data: {kept}\n"]
        for inclusive in ("no", "yes"):
            r = subprocess.run(["callgrind_annotate", f"--inclusive={inclusive}", "--threshold=99",
                                str(data)], capture_output=True, text=True)
            parts.append(f"==== callgrind_annotate --inclusive={inclusive}\n"
                         + "\n".join(r.stdout.splitlines()[:70]))
        return "\n".join(parts)

    def profile_perf(self):
        """The whole machine sampled with perf's cpu-clock (a software timer:
        no hardware counters needed) while the PostgreSQL proxy takes first
        deliveries at 64 connections: CPU by process, then the proxy's and
        PostgreSQL's top functions (user and kernel). --profile-scenario picks
        another load."""
        data = self.tmp / "perf.data"
        c = 64 if 64 in self.a.concurrency else max(self.a.concurrency)
        scenario = self.a.profile_scenario
        self.run_one(BY_NAME[scenario], c, 0, 0, record=False, duration=2)  # warm
        perf = self.procs.start("perf", ["perf", "record", "-a", "-e", "cpu-clock", "-F", "999",
                                         "-o", str(data)], log=self.tmp / "perf.log")
        time.sleep(1)
        run = self.run_one(BY_NAME[scenario], c, 1, 1, record=False, duration=self.a.profile_seconds)
        self.procs.stop(perf, sig=signal.SIGINT, timeout=60)
        parts = [f"perf cpu-clock, all CPUs: {scenario} at {c} connections for {self.a.profile_seconds:g} s: "
                 f"{run.rps:.0f} req/s, p50 {run.p50_ms:.2f} ms; CPU (cores) {run.cpu_cores}\n"]
        def report(*args):
            r = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--no-children", *args],
                               capture_output=True, text=True)
            rows = []
            for line in r.stdout.splitlines():
                m = re.match(r"\s*([\d.]+)%\s+(.*?)\s*$", line)
                if m:
                    rows.append((float(m.group(1)), " ".join(m.group(2).split())))
            return rows

        by_comm = report("--sort", "comm")
        parts.append("==== CPU samples by process name (all CPUs; swapper = idle)\n" + "\n".join(
            f"  {pct:6.2f}%  {name}" for pct, name in by_comm if pct >= 0.5))
        proxy = report("--pid", str(self.proxy_pg.proc.pid), "--percentage", "relative",
                       "--sort", "sym", "--percent-limit", "0")
        groups = {}
        for pct, sym in proxy:
            groups[component(sym)] = groups.get(component(sym), 0.0) + pct
        parts.append("==== dedupe-proxy's samples by component\n" + "\n".join(
            f"  {pct:6.2f}%  {name}" for name, pct in sorted(groups.items(), key=lambda kv: -kv[1])))
        parts.append("==== dedupe-proxy's top functions (% of the proxy's samples)\n" + "\n".join(
            f"  {pct:6.2f}%  {sym[:150]}" for pct, sym in proxy[:45]))
        pg = report("--comm", "postgres", "--percentage", "relative", "--sort", "dso,sym",
                    "--percent-limit", "0.7")
        parts.append("==== PostgreSQL's top functions (% of PostgreSQL's samples)\n" + "\n".join(
            f"  {pct:6.2f}%  {sym[:150]}" for pct, sym in pg[:30]))
        return "\n".join(parts)


COMPONENTS = [
    ("kernel", r"^\[k\]"),
    ("PostgreSQL client (tokio-postgres, deadpool)", r"tokio_postgres|postgres_protocol|postgres_types|deadpool"),
    ("logging (tracing, fmt)", r"tracing|core::fmt|alloc::fmt|fmt::write|Formatter|Display"),
    ("metrics (prometheus)", r"prometheus"),
    ("sha256", r"sha2|sha256|compress256"),
    ("HTTP (hyper, http, httparse)", r"hyper|\bhttp::|httparse|http_body|h2::"),
    ("tokio runtime, timers, channels", r"tokio|futures_|mio::"),
    ("memory (malloc, memcpy)", r"malloc|free|realloc|memcpy|memmove|memset|_int_|cfree|bytes::"),
    ("dedupe-proxy's own code", r"dedupe_proxy"),
]


def component(symbol):
    """The part of the stack a sampled function belongs to (first match)."""
    for name, pattern in COMPONENTS:
        if re.search(pattern, symbol):
            return name
    return "other (libc, std, ...)"


class LoadCommand:
    """A load generator started inside a sampler, bounded in time."""

    def __init__(self, procs, name, argv, env, timeout):
        self.procs, self.name, self.argv, self.env, self.timeout = procs, name, argv, env, timeout

    def start(self, sampler):
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, stdin=subprocess.DEVNULL, env=self.env,
                                     start_new_session=True)
        self.procs.live.append((self.name, self.proc))
        sampler.roles[self.proc.pid] = "client"

    def wait(self):
        try:
            out, err = self.proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.procs.stop(self.proc, sig=signal.SIGKILL)
            raise BenchError(f"{self.name} ran past {self.timeout:.0f}s; killed")
        finally:
            self.procs._forget(self.proc)
        return self.proc.returncode, out, err


@dataclass
class Proxy:
    name: str
    proc: subprocess.Popen
    port: int
    admin: int
    log: Path
    conf: Path

    def metrics(self):
        values = {}
        for line in http_get(f"http://127.0.0.1:{self.admin}/metrics").splitlines():
            if line.startswith(("dedupe_requests_total", "dedupe_payload_mismatch_total",
                                "dedupe_store_duration_seconds_sum", "dedupe_store_duration_seconds_count")):
                key, _, value = line.rpartition(" ")
                values[key] = float(value)
        return values


def mean_claim_ms(before, after):
    """The mean claim time between two scrapes, or None without claims."""
    def delta(series):
        key = f'dedupe_store_duration_seconds_{series}{{op="claim"}}'
        return after.get(key, 0.0) - before.get(key, 0.0)
    count = delta("count")
    return round(delta("sum") / count * 1000, 4) if count else None


def read_response(sock):
    """Reads one HTTP/1.1 response with a Content-Length; returns its status."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise BenchError("connection closed before the response headers")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1])


def strip_ansi(s):
    return re.sub(r"\x1b\[[0-9;]*m", "", s)


def percentile(sorted_values, q):
    if not sorted_values:
        return 0.0
    k = (len(sorted_values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def print_facts(command, machine, settings, notes):
    print(f"$ {command}")
    for k, v in machine.items():
        print(f"  {k:<18s} {v}")
    print(f"  {'settings':<18s} " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    for note in notes:
        print(f"  {note}")
    print(flush=True)


def reprint(path):
    """Prints the report of a saved run again and redraws its plot."""
    from types import SimpleNamespace
    doc = json.loads(Path(path).read_text())
    runs = [Run(**r) for r in doc["runs"]]
    rss = doc.get("rss", {})
    load = rss.get("load")
    if load and "sampled_max_vm_rss_kib_by_concurrency" in load:
        load["sampled_max_vm_rss_kib_by_concurrency"] = {
            int(c): v for c, v in load["sampled_max_vm_rss_kib_by_concurrency"].items()}
    stamp = Path(path).stem.removeprefix("bench-")
    a = SimpleNamespace(concurrency=doc["settings"]["concurrency"])
    bench = SimpleNamespace(a=a, runs=runs, rss=rss, notes=doc.get("notes", []), machine=doc["machine"],
                            stamp=stamp)
    print_facts(doc["command"], doc["machine"], doc["settings"], [])
    report = Report(bench)
    report.print()
    svg = Path(path).parent / f"throughput-{stamp}.svg"
    if plot(report.summary, a.concurrency, svg, doc["machine"]):
        print(f"\nplot:    {svg}")


def command_line():
    """The command as typed, with the BENCH_* variables that shaped it."""
    variables = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
                 if (k.startswith("BENCH_") and k != "BENCH_COMMAND") or k == "CARGO_TARGET_DIR"]
    typed = os.environ.get("BENCH_COMMAND") or " ".join(map(shlex.quote, sys.argv))
    return " ".join([*variables, typed])


def machine_facts(pg, proxy_bin):
    def cmd(*argv):
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=10)
            return (r.stdout + r.stderr).strip().splitlines()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            return "?"
    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    code = ["src", "Cargo.toml", "Cargo.lock"]
    commit = cmd("git", "-C", str(ROOT), "log", "-1", "--format=%h", "--", *code)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", *code],
                           capture_output=True, text=True).stdout.strip()
    with open("/proc/meminfo") as f:
        mem = f.readline().split()[1]
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "kernel": f"{platform.system()} {platform.release()}",
        "memory": f"{int(mem) // 1024} MiB",
        "load average": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "postgresql": pg.sql("SELECT version()").split(" on ")[0],
        "nginx": cmd("nginx", "-v").replace("nginx version: ", ""),
        "wrk": cmd("wrk", "-v").split(" Copyright")[0],
        "pgbench": cmd("pgbench", "--version"),
        "dedupe-proxy": f"{commit}{' + uncommitted changes' if dirty else ''} (last commit to src/),"
                        f" {proxy_bin}",
    }


# --------------------------------------------------------------------------
# Report


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


class Report:
    def __init__(self, bench: Bench):
        self.b = bench
        self.runs = bench.runs
        self.conc = bench.a.concurrency
        self.summary = self.summarise()
        self.ratios = self.pair_ratios()
        self.latency = self.added_latency()
        self.targets = self.check_targets()

    def of(self, scenario, c):
        return [r for r in self.runs if r.scenario == scenario and r.concurrency == c]

    def summarise(self):
        rows = []
        for s in SCENARIOS:
            for c in self.conc:
                runs = self.of(s.name, c)
                if not runs:
                    continue
                cpu = {}
                for key in sorted({k for r in runs for k in r.cpu_cores}):
                    cpu[key] = round(med([r.cpu_cores.get(key, 0.0) for r in runs]), 2)
                rows.append({
                    "scenario": s.name, "title": s.title, "tool": s.tool, "concurrency": c,
                    "clients": max(r.clients for r in runs), "reps": len(runs),
                    "rps_median": round(med([r.rps for r in runs]), 1),
                    "rps_min": round(min(r.rps for r in runs), 1),
                    "rps_max": round(max(r.rps for r in runs), 1),
                    "p50_ms": round(med([r.p50_ms for r in runs]), 3),
                    "p99_ms": round(med([r.p99_ms for r in runs]), 3),
                    "cpu_cores": cpu,
                    "claim_ms": (round(med([r.claim_ms for r in runs]), 4)
                                 if all(r.claim_ms is not None for r in runs) else None),
                })
        return rows

    def pair(self, num, den, c, attr="rps", op=lambda a, b: a / b if b else None):
        values = []
        for r in self.of(num, c):
            other = [o for o in self.of(den, c) if o.rep == r.rep]
            if other:
                v = op(getattr(r, attr), getattr(other[0], attr))
                if v is not None:
                    values.append(v)
        return values

    def pair_ratios(self):
        out = []
        for num, den, what in RATIOS:
            for c in self.conc:
                values = self.pair(num, den, c)
                if values:
                    out.append({"numerator": num, "denominator": den, "what": what, "concurrency": c,
                                "median": round(med(values), 3), "min": round(min(values), 3),
                                "max": round(max(values), 3), "per_rep": [round(v, 3) for v in values]})
        return out

    def ratio(self, num, den, c):
        return next((r for r in self.ratios if r["numerator"] == num and r["denominator"] == den
                     and r["concurrency"] == c), None)

    def row(self, scenario, c):
        return next((r for r in self.summary if r["scenario"] == scenario and r["concurrency"] == c), None)

    def added_latency(self):
        c = 16 if 16 in self.conc else min(self.conc)
        diff = lambda a, b: a - b
        p50 = self.pair("pg-first", "nginx-direct", c, "p50_ms", diff)
        p99 = self.pair("pg-first", "nginx-direct", c, "p99_ms", diff)
        pgb = self.row("pgbench-first", c)
        return {"concurrency": c,
                "p50_added_ms": round(med(p50), 3) if p50 else None,
                "p99_added_ms": round(med(p99), 3) if p99 else None,
                "pgbench_claim_settle_p50_ms": pgb["p50_ms"] if pgb else None,
                "pgbench_claim_settle_p99_ms": pgb["p99_ms"] if pgb else None}

    def check_targets(self):
        t = []

        def add(name, value, goal, ok, unit=""):
            if value is None:
                return
            t.append({"target": name, "value": value, "goal": goal,
                      "met": None if value is None else bool(ok), "unit": unit})

        r = self.ratio("pg-first", "pgbench-first", 64)
        add("first deliveries vs pgbench claim+settle at 64", r and r["median"], ">= 1.0x",
            r and r["median"] >= 1.0, "x")
        for c in self.conc:
            r = self.ratio("pg-dup", "pgbench-insert", c)
            add(f"duplicates vs pgbench's bare duplicate INSERT at {c}", r and r["median"], ">= 1.0x",
                r and r["median"] >= 1.0, "x")
        for c in self.conc:
            r = self.ratio("proxy-pass", "nginx-proxy", c)
            add(f"pass-through vs nginx proxy_pass at {c}", r and r["median"], ">= 1.0x",
                r and r["median"] >= 1.0, "x")
        lat = self.latency
        if lat["p50_added_ms"] is not None and lat["pgbench_claim_settle_p50_ms"] is not None:
            goal = lat["pgbench_claim_settle_p50_ms"] + 0.3
            add(f"p50 added over direct at {lat['concurrency']}", lat["p50_added_ms"],
                f"<= {goal:.3f} ms (pgbench claim+settle p50 + 0.3)", lat["p50_added_ms"] <= goal, "ms")
        idle = self.b.rss.get("idle")
        if idle:
            mib = idle["vm_hwm_kib"] / 1024
            add(f"peak RSS, {idle['connections']} idle keep-alive connections", round(mib, 1),
                "<= 32 MiB with 1000", mib <= 32, "MiB")
            if idle["connections"] != 1000:
                t[-1]["met"] = None  # the target is for 1000 connections
        load = self.b.rss.get("load", {}).get("sampled_max_vm_rss_kib_by_concurrency", {})
        if 256 in load:
            hwm = self.b.rss["load"]["vm_hwm_kib"] / 1024
            add("peak RSS under load up to 256 (VmHWM)", round(hwm, 1), "<= 64 MiB", hwm <= 64, "MiB")
        return t

    # ---- output

    def print(self):
        print("\n== Throughput (median of repetitions; ratio = median of per-repetition ratios)")
        head = f"{'scenario':<15s} {'conc':>5s} {'req/s':>10s} {'min..max':>17s} {'p50 ms':>8s} {'p99 ms':>8s}  ratio vs baseline"
        print(head)
        print("-" * (len(head) + 10))
        for s in SCENARIOS:
            for c in self.conc:
                row = self.row(s.name, c)
                if not row:
                    continue
                base = BASELINE.get(s.name)
                r = self.ratio(s.name, base, c) if base else None
                ratio = f"{r['median']:.3f}x {base} ({r['min']:.2f}..{r['max']:.2f})" if r else ""
                clients = f" [{row['clients']} clients]" if row["clients"] != c else ""
                spread = f"{row['rps_min']:.0f}..{row['rps_max']:.0f}"
                print(f"{s.name:<15s} {c:>5d} {row['rps_median']:>10.0f} {spread:>17s} {row['p50_ms']:>8.2f} "
                      f"{row['p99_ms']:>8.2f}  {ratio}{clients}")
        print("\n== Ratios (median of per-repetition ratios, min..max)")
        for num, den, what in RATIOS:
            cells = []
            for c in self.conc:
                r = self.ratio(num, den, c)
                if r:
                    cells.append(f"{c}: {r['median']:.3f} ({r['min']:.2f}..{r['max']:.2f})")
            if cells:
                print(f"  {num + ' / ' + den:<30s} {'   '.join(cells)}   {what}")
        lat = self.latency
        print(f"\n== Latency added over direct nginx at {lat['concurrency']} connections (first deliveries)")
        print(f"  p50 added {fmt(lat['p50_added_ms'])} ms, p99 added {fmt(lat['p99_added_ms'])} ms;"
              f" pgbench claim+settle p50 {fmt(lat['pgbench_claim_settle_p50_ms'])} ms,"
              f" p99 {fmt(lat['pgbench_claim_settle_p99_ms'])} ms")
        print("\n== Memory (dedupe-proxy on PostgreSQL)")
        idle = self.b.rss.get("idle")
        if idle:
            print(f"  {idle['connections']} idle keep-alive connections: VmHWM {idle['vm_hwm_kib'] / 1024:.1f} MiB,"
                  f" VmRSS {idle['vm_rss_kib'] / 1024:.1f} MiB (fresh process: {idle['rss_before_kib'] / 1024:.1f} MiB)")
        load = self.b.rss.get("load", {})
        sampled = load.get("sampled_max_vm_rss_kib_by_concurrency", {})
        if sampled:
            # The warm-up runs at the highest concurrency first, and freed
            # memory is rarely returned: every value includes that peak.
            print("  largest VmRSS sampled during the runs at "
                  + ", ".join(f"{c}: {kib / 1024:.1f} MiB" for c, kib in sorted(sampled.items()))
                  + " (cumulative: one process serves all loads)")
        if load.get("vm_hwm_kib"):
            print(f"  peak RSS (VmHWM) after all loads, up to {max(self.conc)} connections:"
                  f" {load['vm_hwm_kib'] / 1024:.1f} MiB"
                  f" (SQLite proxy: {load['sqlite_vm_hwm_kib'] / 1024:.1f} MiB)")
        print("\n== CPU during the runs (cores busy, medians; irq = softirq/network stack,"
              " other = everything else on the machine)")
        roles = ["proxy", "postgres", "nginx", "client", "irq", "other", "machine"]
        print(f"  {'scenario':<15s} {'conc':>5s} " + " ".join(f"{r:>9s}" for r in roles) + f" {'us/req proxy':>13s}")
        for row in self.summary:
            cpu = row["cpu_cores"]
            per_req = cpu.get("proxy", 0) / row["rps_median"] * 1e6 if row["rps_median"] and cpu.get("proxy") else None
            print(f"  {row['scenario']:<15s} {row['concurrency']:>5d} "
                  + " ".join(f"{cpu.get(r, 0.0):>9.2f}" for r in roles)
                  + f" {fmt(per_req, 1):>13s}")
        claimed = [row for row in self.summary if row.get("claim_ms") is not None]
        if claimed:
            # A closed loop of c senders at r requests/s keeps each request
            # c / r seconds on average (Little's law), the sender's side included.
            print("\n== Where a request's time goes (means, medians over repetitions): the claim"
                  " (queued for a batch, at the database, back) against the whole round trip")
            print(f"  {'scenario':<15s} {'conc':>5s} {'round trip ms':>14s} {'claim ms':>9s} {'share':>6s}")
            for row in claimed:
                trip = row["concurrency"] / row["rps_median"] * 1000 if row["rps_median"] else None
                share = f"{row['claim_ms'] / trip:.0%}" if trip else "--"
                print(f"  {row['scenario']:<15s} {row['concurrency']:>5d} {fmt(trip, 3):>14s}"
                      f" {row['claim_ms']:>9.3f} {share:>6s}")
        print("\n== Targets")
        for t in self.targets:
            mark = {True: "met ", False: "MISS", None: " -- "}[t["met"]]
            digits = 1 if t["unit"] == "MiB" else 3
            print(f"  [{mark}] {t['target']}: {fmt(t['value'], digits)} {t['unit']} (goal {t['goal']})")
        for note in self.b.notes:
            print(f"  {note}")

    def save(self):
        out = Path(self.b.a.results)
        out.mkdir(parents=True, exist_ok=True)
        doc = {
            "format": "dedupe-proxy-bench/1",
            "command": command_line(),
            "machine": self.b.machine, "settings": self.b.settings(),
            "notes": self.b.notes,
            "summary": self.summary, "ratios": self.ratios, "latency": self.latency,
            "rss": self.b.rss, "targets": self.targets,
            "runs": [r.__dict__ for r in self.runs],
        }
        json_path = out / f"bench-{self.b.stamp}.json"
        json_path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        csv_path = out / f"bench-{self.b.stamp}.csv"
        with open(csv_path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["scenario", "concurrency", "clients", "rep", "order", "rps", "requests", "seconds",
                        "p50_ms", "p90_ms", "p99_ms", "cpu_proxy", "cpu_postgres", "cpu_nginx",
                        "cpu_client", "cpu_irq", "cpu_other", "cpu_machine", "rss_max_kib"])
            for r in self.runs:
                cpu = r.cpu_cores
                w.writerow([r.scenario, r.concurrency, r.clients, r.rep, r.order, round(r.rps, 1), r.requests,
                            round(r.seconds, 3), round(r.p50_ms, 3), round(r.p90_ms, 3), round(r.p99_ms, 3),
                            *(cpu.get(k, 0.0) for k in ("proxy", "postgres", "nginx", "client", "irq",
                                                         "other", "machine")), r.rss_max_kib or ""])
        shutil.copyfile(json_path, out / "latest.json")
        svg = out / "throughput.svg"
        if plot(self.summary, self.conc, svg, self.b.machine):
            shutil.copyfile(svg, out / f"throughput-{self.b.stamp}.svg")
            print(f"\nplot:    {svg}")
        print(f"results: {json_path}\n         {csv_path}")


def fmt(v, digits=3):
    return "n/a" if v is None else f"{v:.{digits}f}"


def plot(summary, conc, path, machine):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (apt-get install python3-matplotlib): no plot")
        return False
    panels = [("PostgreSQL store: proxy vs pgbench, same SQL", "linear",
               ["pg-first", "pgbench-first", "pg-dup", "pgbench-dup", "pgbench-insert"]),
              ("SQLite store (log scale)", "log", ["sqlite-first", "sqlite-dup"]),
              ("Unmatched pass-through", "linear", ["proxy-pass", "nginx-proxy", "nginx-direct"])]
    style = {"pg-first": ("C0", "-", "o"), "pgbench-first": ("C0", "--", "s"),
             "pg-dup": ("C1", "-", "o"), "pgbench-dup": ("C1", "--", "s"),
             "pgbench-insert": ("C1", ":", "v"),
             "sqlite-first": ("C2", "-", "^"), "sqlite-dup": ("C3", "-", "^"),
             "proxy-pass": ("C0", "-", "o"), "nginx-proxy": ("C4", "--", "s"),
             "nginx-direct": ("C7", ":", "d")}
    fig, axes = plt.subplots(1, 3, figsize=(17, 6.4))
    for ax, (title, yscale, names) in zip(axes, panels):
        for name in names:
            rows = [r for r in summary if r["scenario"] == name]
            if not rows:
                continue
            xs = [r["concurrency"] for r in rows]
            ys = [r["rps_median"] for r in rows]
            err = [[r["rps_median"] - r["rps_min"] for r in rows], [r["rps_max"] - r["rps_median"] for r in rows]]
            color, line, marker = style[name]
            ax.errorbar(xs, ys, yerr=err, color=color, linestyle=line, marker=marker, capsize=3,
                        label=f"{name}: {BY_NAME[name].title}")
            for r in rows:
                if r["clients"] != r["concurrency"]:
                    ax.annotate(f"{r['clients']} clients", (r["concurrency"], r["rps_median"]),
                                textcoords="offset points", xytext=(-48, 6), fontsize=7, color=color)
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc)
        ax.set_xticklabels([str(c) for c in conc])
        ax.set_xlabel("concurrent connections (pgbench: clients)")
        ax.set_ylabel("requests (pgbench: events) per second")
        if yscale == "log":
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        # Below the axes: inside, the legend hid whichever curve ran under it.
        ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    fig.suptitle(f"dedupe-proxy {machine['dedupe-proxy'].split(',')[0]} — {machine['nproc']} CPUs, "
                 f"{machine['date']} — median of repetitions, bars: min..max", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    fig.savefig(path.with_suffix(".png"), dpi=90)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------


def main(argv):
    a = parse_args(argv)
    if a.check_statements:
        try:
            for name, sql in pgbench_statements().items():
                print(f"{name}: {sql}", end="")
        except BenchError as e:
            print(f"bench: {e}", file=sys.stderr)
            return 1
        return 0
    if a.report:
        reprint(a.report)
        return 0
    bench = Bench(a)

    def on_signal(signum, _frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        bench.main()
        return 0
    except BenchError as e:
        print(f"\nbench: FAILED: {e}", file=sys.stderr)
        for p in (bench.tmp / "proxy-pg.log", bench.tmp / "proxy-sqlite.log"):
            if p.exists() and p.stat().st_size:
                tail = strip_ansi(p.read_text(errors="replace"))[-1500:]
                print(f"--- last lines of {p.name}:\n{tail}", file=sys.stderr)
        return 1
    finally:
        bench.procs.stop_all()
        if os.environ.get("BENCH_KEEP_TMP"):
            print(f"kept {bench.tmp}", file=sys.stderr)
        else:
            shutil.rmtree(bench.tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
