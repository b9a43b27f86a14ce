"""A Spark standalone cluster of several hosts on one machine, each worker host in its own Linux
network namespace, for tests (tests/test_netns_cluster.py) and scripts.

Each host is a network namespace (``ip netns add``) with a veth pair to a bridge in the root
namespace, its own address (10.77.N.11, .12, ...; the bridge is 10.77.N.1), its own host name
(a UTS namespace, and an ``/etc/netns/<ns>/hosts`` that ``ip netns exec`` mounts over
``/etc/hosts``) and its own local directories (``SPARK_LOCAL_DIRS``, ``SPARK_WORKER_DIR``,
``TMPDIR``): state a task leaves on its executor's local disk is on that host only. The master
runs in the root namespace on the bridge's address; a driver runs in the root namespace too
and reaches the master and the workers over the bridge (:meth:`Cluster.driver_conf`). Every
namespace sees the same file system, which plays the part of a cluster's shared storage
(checkpoints, Delta tables, work directories).

The daemons are pip PySpark's own: ``sbin/spark-daemon.sh start ...Master`` and
``...Worker``, which is what ``start-master.sh`` and ``start-worker.sh`` run (pip PySpark
ships ``spark-daemon.sh`` but not those two wrappers). Each worker host runs it through
``ip netns exec``, with ``SPARK_PID_DIR``, ``SPARK_LOG_DIR`` and ``SPARK_LOCAL_IP`` of its own.

Names carry the pid of the process that made the cluster (``sckn<pid>-h1``, bridge
``sckn<pid>br``): :func:`remove_stale` removes what a run killed before it could clean up left
(its owner is gone), and two live runs never share a name or a subnet. :meth:`Cluster.stop`
(also registered with ``atexit``) stops the daemons, SIGKILLs whatever is left in each
namespace and deletes the namespaces and the bridge.

Hosts can be lost (tests/test_netns_cluster.py, "host loss"): :func:`kill_host` SIGKILLs every
process in a host's namespace and wipes its local disk, :func:`restart_host` starts its worker
again, :func:`partition_host` and :func:`heal_host` cut it off the network and reconnect it.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyspark
from helpers import wait_for

ROOT = Path(__file__).resolve().parent.parent
SPARK_HOME = Path(os.environ.get("SPARK_HOME") or Path(pyspark.__file__).parent)
PREFIX = "sckn"  # every namespace, bridge, veth and marker of these clusters starts with it
MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
_NAME = re.compile(rf"^{PREFIX}(\d+)")
NETNS_ETC = Path("/etc/netns")


class Unavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no ``ip``, no permission)."""


@dataclasses.dataclass(frozen=True)
class Host:
    """One worker host: its namespace, address, host name and directories."""

    name: str  # host1, host2, ...
    netns: str
    hostname: str  # the host name its processes see (os.uname().nodename)
    ip: str
    veth: str  # the root namespace's end of its veth pair, on the bridge
    directory: Path

    @property
    def local_dir(self) -> Path:
        return self.directory / "local"

    @property
    def env(self) -> dict[str, str]:
        """What its worker daemon runs with (besides the cluster's common environment)."""
        return {"SPARK_LOCAL_IP": self.ip, "SPARK_LOCAL_DIRS": str(self.local_dir),
                "SPARK_WORKER_DIR": str(self.directory / "work"),
                "SPARK_PID_DIR": str(self.directory / "run"),
                "SPARK_LOG_DIR": str(self.directory / "logs"),
                "SPARK_IDENT_STRING": self.netns, "TMPDIR": str(self.directory / "tmp")}


@dataclasses.dataclass
class Cluster:
    """A running cluster: ``master_url`` for drivers, ``hosts`` by name."""

    owner: str  # sckn<pid>: the prefix of every name of this cluster
    bridge: str
    bridge_ip: str
    master_url: str
    directory: Path
    hosts: list[Host]
    java_options: str
    stopped: bool = False
    worker_cores: int = 1  # what each worker offers (restart_host starts one alike)
    worker_memory: str = "1g"
    worker_timeout_s: int | None = None  # the master's spark.worker.timeout; None: Spark's 60

    @property
    def master_env(self) -> dict[str, str]:
        env = {"SPARK_LOCAL_IP": self.bridge_ip, "SPARK_PID_DIR": str(self.directory / "run"),
               "SPARK_LOG_DIR": str(self.directory / "logs"),
               "SPARK_IDENT_STRING": f"{self.owner}-master"}
        if self.worker_timeout_s is not None:  # how soon the master drops a silent worker
            env["SPARK_MASTER_OPTS"] = f"-Dspark.worker.timeout={self.worker_timeout_s}"
        return env

    @property
    def event_log_dir(self) -> Path:
        """Where drivers started with :meth:`driver_conf` write Spark's event logs."""
        return self.directory / "eventlog"

    def host_by_ip(self) -> dict[str, str]:
        return {h.ip: h.name for h in self.hosts}

    def host_by_hostname(self) -> dict[str, str]:
        return {h.hostname: h.name for h in self.hosts}

    def driver_conf(self, *, executor_memory: str = "768m",
                    python_path: str = "") -> dict[str, str]:
        """Spark settings of a driver in the root namespace: this master, the bridge's address
        for the driver, one 1-core executor per host (the first job waits until all are up),
        no locality wait (tasks go to whichever host is free), this interpreter and
        ``python_path`` on the executors, Spark's event log (uncompressed) under
        :attr:`event_log_dir`."""
        marker = f"-D{PREFIX}.owner={self.owner}"  # found by remove_stale if the run dies
        return {
            "spark.master": self.master_url,
            "spark.driver.host": self.bridge_ip,
            "spark.driver.bindAddress": self.bridge_ip,
            "spark.driver.memory": "1g",
            "spark.executor.memory": executor_memory,
            "spark.executor.cores": "1",
            "spark.cores.max": str(len(self.hosts)),
            "spark.scheduler.minRegisteredResourcesRatio": "1.0",
            "spark.scheduler.maxRegisteredResourcesWaitingTime": "120s",
            "spark.locality.wait": "0s",
            "spark.pyspark.python": sys.executable,
            "spark.pyspark.driver.python": sys.executable,
            "spark.executorEnv.PYTHONPATH": python_path,
            "spark.executorEnv.PYSPARK_PYTHON": sys.executable,
            "spark.eventLog.enabled": "true",
            "spark.eventLog.compress": "false",
            "spark.eventLog.rolling.enabled": "false",
            "spark.eventLog.dir": self.event_log_dir.as_uri(),
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            "spark.driver.extraJavaOptions":
                f"-Dlog4j2.configurationFile=file:{ROOT / 'conf' / 'log4j2.properties'} "
                f"{self.java_options} {marker}",
            "spark.executor.extraJavaOptions": f"{self.java_options} {marker}",
        }

    def stop(self) -> None:
        """Stop the workers and the master, SIGKILL what is left in each namespace, delete the
        namespaces, the bridge and the hosts files. Safe to call twice, and after a failed
        start."""
        if self.stopped:
            return
        self.stopped = True
        env = _daemon_env(self.java_options, self.owner)
        stops = [_popen(["ip", "netns", "exec", h.netns, "bash",
                         str(SPARK_HOME / "sbin" / "spark-daemon.sh"), "stop", WORKER_CLASS, "1"],
                        {**env, **h.env}) for h in self.hosts if _netns_exists(h.netns)]
        stops.append(_popen(["bash", str(SPARK_HOME / "sbin" / "spark-daemon.sh"), "stop",
                             MASTER_CLASS, "1"], {**env, **self.master_env}))
        for proc in stops:
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
        _remove(self.owner)


def unavailable() -> str | None:
    """Why a cluster cannot be made here, or None."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux's, this is {sys.platform}"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command"
    # each host's hosts file goes there, and `ip netns exec` mounts it over /etc/hosts
    etc = NETNS_ETC if NETNS_ETC.exists() else NETNS_ETC.parent
    if not os.access(etc, os.W_OK):
        return f"cannot write to {etc}"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def start_cluster(directory: Path, *, hosts: int = 3, cores: int = 1, memory: str = "1g",
                  java_options: str = "", timeout: float = 180,
                  worker_timeout_s: int | None = None) -> Cluster:
    """Make the bridge and ``hosts`` namespaces, start the master and one worker per host,
    and return once every worker registered with the master. Raises :class:`Unavailable`
    where namespaces cannot be made; anything made is removed again if the start fails.
    ``worker_timeout_s``: the master's ``spark.worker.timeout`` (Spark's default 60 s), how
    long a worker may go unheard before the master drops it and its executors."""
    reason = unavailable()
    if reason:
        raise Unavailable(reason)
    remove_stale()
    owner = f"{PREFIX}{os.getpid()}"
    _remove(owner)  # a cluster this process made before and did not stop
    subnet = _free_subnet()
    (directory / "eventlog").mkdir(parents=True, exist_ok=True)
    cluster = Cluster(owner=owner, bridge=f"{owner}br", bridge_ip=f"{subnet}.1",
                      master_url="", directory=directory, hosts=[],
                      java_options=java_options, worker_cores=cores, worker_memory=memory,
                      worker_timeout_s=worker_timeout_s)
    atexit.register(cluster.stop)
    try:
        _network(cluster, subnet, hosts)
        _start_daemons(cluster, cores=cores, memory=memory, timeout=timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _network(cluster: Cluster, subnet: str, count: int) -> None:
    _ip("link", "add", cluster.bridge, "type", "bridge")
    _ip("addr", "add", f"{cluster.bridge_ip}/24", "dev", cluster.bridge)
    _ip("link", "set", cluster.bridge, "up")
    hosts_file = Path("/etc/hosts").read_text() if Path("/etc/hosts").is_file() else ""
    for n in range(1, count + 1):
        host = Host(name=f"host{n}", netns=f"{cluster.owner}-h{n}",
                    hostname=f"{cluster.owner}-h{n}", ip=f"{subnet}.{10 + n}",
                    veth=f"{cluster.owner}v{n}", directory=cluster.directory / f"host{n}")
        cluster.hosts.append(host)
        peer = f"{cluster.owner}p{n}"
        _ip("netns", "add", host.netns)
        _ip("link", "add", host.veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", host.netns)
        _ip("link", "set", host.veth, "master", cluster.bridge)
        _ip("link", "set", host.veth, "up")
        _ip("-n", host.netns, "link", "set", peer, "name", "eth0")
        _ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        _ip("-n", host.netns, "link", "set", "eth0", "up")
        _ip("-n", host.netns, "link", "set", "lo", "up")
        # its own host name resolves to its own address (Java looks the local name up)
        etc = NETNS_ETC / host.netns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(f"{hosts_file.rstrip()}\n{host.ip} {host.hostname}\n")
        for sub in ("local", "work", "run", "logs", "tmp"):
            (host.directory / sub).mkdir(parents=True, exist_ok=True)
    _allow_forwarding(cluster.bridge)


BRIDGE_NETFILTER = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")


def _allow_forwarding(bridge: str) -> None:
    """Hosts reach each other through the bridge (shuffle and broadcast fetches go host to
    host). Where bridged traffic passes iptables (br_netfilter loaded) and iptables has rules,
    as where Docker runs (its FORWARD policy drops), accept the bridge's own traffic (removed
    by :func:`_remove`). Without the iptables command there are no such rules to pass (this
    machine: br_netfilter on, no iptables, hosts reach each other)."""
    if not BRIDGE_NETFILTER.exists() or BRIDGE_NETFILTER.read_text().strip() != "1" or \
            not shutil.which("iptables"):
        return
    _run(["iptables", "-I", "FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"])


def _start_daemons(cluster: Cluster, *, cores: int, memory: str, timeout: float) -> None:
    daemon = str(SPARK_HOME / "sbin" / "spark-daemon.sh")
    env = _daemon_env(cluster.java_options, cluster.owner)
    port = _free_port(cluster.bridge_ip)
    cluster.master_url = f"spark://{cluster.bridge_ip}:{port}"
    master = _popen(["bash", daemon, "start", MASTER_CLASS, "1", "--host", cluster.bridge_ip,
                     "--port", str(port), "--webui-port", str(_free_port(cluster.bridge_ip))],
                    {**env, **cluster.master_env})
    workers = [_start_worker(cluster, h, cores=cores, memory=memory) for h in cluster.hosts]
    for proc in (master, *workers):
        out, _ = proc.communicate(timeout=timeout)
        if proc.returncode != 0 or "failed to launch" in out:
            raise RuntimeError(f"a daemon did not start ({proc.returncode}): {out[-3000:]}"
                               + _logs(cluster))
    if not wait_for(lambda: registered(cluster) >= len(cluster.hosts), timeout):
        raise RuntimeError(f"{registered(cluster)} of {len(cluster.hosts)} workers "
                           f"registered with {cluster.master_url} in {timeout} s"
                           + _logs(cluster))


def _start_worker(cluster: Cluster, host: Host, *, cores: int, memory: str
                  ) -> subprocess.Popen[str]:
    """``spark-daemon.sh start ...Worker`` in the host's namespace, under its own host name."""
    return _popen(["ip", "netns", "exec", host.netns, "unshare", "--uts", "--", "bash", "-c",
                   'hostname "$0" && exec bash "$@"', host.hostname,
                   str(SPARK_HOME / "sbin" / "spark-daemon.sh"), "start", WORKER_CLASS, "1",
                   "--host", host.ip, "--cores", str(cores), "--memory", memory,
                   "--work-dir", str(host.directory / "work"), "--webui-port", "0",
                   cluster.master_url],
                  {**_daemon_env(cluster.java_options, cluster.owner), **host.env})


def registered(cluster: Cluster) -> int:
    """Workers the master's log says registered."""
    text = "".join(p.read_text(errors="replace")
                   for p in (cluster.directory / "logs").glob("*.out"))
    return len(set(re.findall(r"Registering worker (\S+)", text)))


def _logs(cluster: Cluster) -> str:
    parts = []
    for path in sorted(cluster.directory.rglob("logs/*.out")):
        parts.append(f"\n--- {path}:\n{path.read_text(errors='replace')[-2000:]}")
    return "".join(parts)


def _daemon_env(java_options: str, owner: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYSPARK_GATEWAY", "SPARK_REMOTE", "SPARK_CONNECT"))}
    env.update(SPARK_HOME=str(SPARK_HOME), PYSPARK_PYTHON=sys.executable,
               SPARK_DAEMON_MEMORY="256m",
               SPARK_DAEMON_JAVA_OPTS=f"{java_options} -D{PREFIX}.owner={owner}".strip())
    return env


# -- losing a host --------------------------------------------------------------------------------
# a host's local disk, what kill_host wipes: its pid files too (a reboot clears /run), or
# spark-daemon.sh would take a killed daemon's unreaped zombie for a live one
LOCAL_SUBDIRS = ("local", "work", "tmp", "run")


def host(cluster: Cluster, name: str) -> Host:
    """The host called ``name`` (host1, host2, ...)."""
    return next(h for h in cluster.hosts if h.name == name)


def host_pids(host: Host) -> list[int]:
    """Every process in the host's network namespace (worker, executor, Python workers)."""
    done = _run(["ip", "netns", "pids", host.netns], check=False)
    return [int(p) for p in done.stdout.split()]


def kill_host(cluster: Cluster, host: Host) -> int:
    """The host dies: SIGKILL every process in its namespace (its worker daemon, executor JVM
    and Python workers: no shutdown hook runs, no connection is closed gracefully), then wipe
    its local disk (``local``, ``work``, ``tmp``, ``run``: shuffle files, RocksDB copies,
    spilled state, the executor's work directory, pid files), as a replaced machine comes
    back empty; its daemon logs stay, for the test's report. Its namespace and
    address stay, so :func:`restart_host` can start a worker there again. Returns how many
    processes were killed."""
    killed = 0
    for _ in range(10):  # again, for a Python worker forked while the others were killed
        pids = host_pids(host)
        if not pids:
            break
        _kill(pids)
        killed += len(pids)
    for sub in LOCAL_SUBDIRS:
        shutil.rmtree(host.directory / sub, ignore_errors=True)
        (host.directory / sub).mkdir(parents=True, exist_ok=True)
    return killed


def worker_registrations(cluster: Cluster, host: Host) -> int:
    """How many times the master's log says a worker of ``host`` registered (a restarted or
    reconnected worker registers again)."""
    text = "".join(p.read_text(errors="replace")
                   for p in (cluster.directory / "logs").glob("*.out"))
    return len(re.findall(rf"Registering worker {re.escape(host.ip)}:\d+", text))


def restart_host(cluster: Cluster, host: Host, timeout: float = 120) -> None:
    """Start the host's worker daemon again (after :func:`kill_host`) and wait until it
    registered with the master, which then gives a running application's missing executor
    to it: the cluster is back to all its hosts."""
    before = worker_registrations(cluster, host)
    proc = _start_worker(cluster, host, cores=cluster.worker_cores,
                         memory=cluster.worker_memory)
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode != 0 or "failed to launch" in out:
        raise RuntimeError(f"{host.name}'s worker did not start again ({proc.returncode}): "
                           f"{out[-3000:]}" + _logs(cluster))
    if not wait_for(lambda: worker_registrations(cluster, host) > before, timeout):
        raise RuntimeError(f"{host.name}'s restarted worker did not register with "
                           f"{cluster.master_url} in {timeout} s" + _logs(cluster))


def partition_host(cluster: Cluster, host: Host) -> None:
    """Cut the host off the network: its veth's end on the bridge goes down, so every packet
    to or from it is dropped silently (no reset, no error its peers see: a pulled cable, a
    dead switch port). Its processes keep running, its namespace still has its address and a
    route, and the shared file system (not networked here) stays reachable, as a storage
    network that a partition spared would. Undone by :func:`heal_host`. (tc netem would drop
    traffic too, but this kernel has no sch_netem; there is no iptables command.)"""
    _ip("link", "set", host.veth, "down")


def heal_host(cluster: Cluster, host: Host) -> None:
    """Reconnect a host cut off by :func:`partition_host`."""
    _ip("link", "set", host.veth, "up")


# -- what ran where -------------------------------------------------------------------------------
def task_hosts(event_log_dir: Path, *, since_ms: int = 0,
               until_ms: int | None = None) -> Counter[str]:
    """Tasks per executor host (its address) in Spark's event logs under ``event_log_dir``
    (every application, finished or in progress), of the tasks launched in
    ``[since_ms, until_ms]``."""
    hosts: Counter[str] = Counter()
    for path in sorted(event_log_dir.glob("*")):
        for line in path.read_text(errors="replace").splitlines():
            if '"SparkListenerTaskEnd"' not in line:
                continue
            try:
                info = json.loads(line)["Task Info"]
            except (ValueError, KeyError):  # the torn last line of a killed driver's log
                continue
            launched = int(info.get("Launch Time", 0))
            if launched >= since_ms and (until_ms is None or launched <= until_ms):
                hosts[info["Host"]] += 1
    return hosts


def netns_of(pid: int) -> str | None:
    """The network namespace (by name) process ``pid`` is in, None for the root one."""
    try:
        target = os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None
    for name in _namespaces():
        with contextlib.suppress(OSError):
            if os.stat(f"/run/netns/{name}").st_ino == target:
                return name
    return None


# -- making and removing --------------------------------------------------------------------------
def remove_stale() -> list[str]:
    """Remove the clusters whose owner process is gone (a run killed before its clean-up):
    their processes, namespaces, bridges and hosts files. Returns their owner names."""
    owners = {m.group(0) for m in map(_NAME.match, _namespaces() + _bridges()) if m}
    if NETNS_ETC.is_dir():
        owners |= {m.group(0) for m in map(_NAME.match, os.listdir(NETNS_ETC)) if m}
    owners |= set(_marked_processes())
    stale = sorted(o for o in owners if not _alive(int(o[len(PREFIX):])))
    for owner in stale:
        _remove(owner)
    with contextlib.suppress(OSError):  # empty: no cluster left
        NETNS_ETC.rmdir()
    return stale


def _remove(owner: str) -> None:
    """Everything named after ``owner``: processes in its namespaces or marked with it
    (SIGKILL), the namespaces (their veths go with them), the bridge, the hosts files."""
    for name in _namespaces():
        if name.startswith(f"{owner}-"):
            pids = _run(["ip", "netns", "pids", name], check=False).stdout.split()
            _kill([int(p) for p in pids])
    _kill(_marked_processes().get(owner, []))
    for name in _namespaces():
        if name.startswith(f"{owner}-"):
            _run(["ip", "netns", "del", name], check=False)
    for name in _bridges():
        if name == f"{owner}br":
            _run(["ip", "link", "del", name], check=False)
    if BRIDGE_NETFILTER.exists() and shutil.which("iptables"):  # _allow_forwarding's rule
        _run(["iptables", "-D", "FORWARD", "-i", f"{owner}br", "-o", f"{owner}br", "-j",
              "ACCEPT"], check=False)
    if NETNS_ETC.is_dir():
        for name in os.listdir(NETNS_ETC):
            if name.startswith(f"{owner}-"):
                shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
        with contextlib.suppress(OSError):  # made for these clusters: gone when none is left
            NETNS_ETC.rmdir()


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not any(_alive(p) for p in pids), 30, interval=0.05)


def _marked_processes() -> dict[str, list[int]]:
    """Processes whose command line carries a cluster's marker (daemons, drivers, executors)."""
    found: dict[str, list[int]] = {}
    flag = re.compile(rb"-D" + PREFIX.encode() + rb"\.owner=(" + PREFIX.encode() + rb"\d+)")
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            m = flag.search(Path(f"/proc/{pid}/cmdline").read_bytes())
        except OSError:
            continue
        if m:
            found.setdefault(m.group(1).decode(), []).append(int(pid))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines()
            if line.strip() and line.startswith(PREFIX)]


def _bridges() -> list[str]:
    out = _run(["ip", "-o", "link", "show", "type", "bridge"], check=False).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()
             if ":" in line]
    return [n for n in names if n.startswith(PREFIX)]


def _netns_exists(name: str) -> bool:
    return name in _namespaces()


def _free_subnet() -> str:
    """10.77.N for the first N no interface of the root namespace has an address in."""
    out = _run(["ip", "-4", "-o", "addr", "show"], check=False).stdout
    used = set(re.findall(r"inet 10\.77\.(\d+)\.", out))
    for n in range(256):
        if str(n) not in used:
            return f"10.77.{n}"
    raise Unavailable("no free 10.77.N.0/24 subnet")


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(command: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")
    return done


def _popen(command: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """A daemon script, in a session of its own (the daemon outlives it)."""
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True,
                            cwd=ROOT)


def main() -> None:
    """``python tests/netns_cluster.py [DIR]``: start a cluster, print its master URL and
    hosts, wait for Enter (or a signal), stop it. ``--clean``: remove stale clusters only."""
    import tempfile

    if sys.argv[1:] == ["--clean"]:
        print("removed", remove_stale() or "nothing")
        return
    directory = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix=PREFIX))
    cluster = start_cluster(directory)
    print(cluster.master_url, [(h.name, h.ip, h.netns) for h in cluster.hosts], flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        input("Enter stops the cluster\n")
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
