"""Ray nodes that are machines of their own, on this one machine (tests and benchmarks only, never
the runtime): `NetnsCluster` starts a Ray head in the root network namespace on a bridge it
creates (10.77.X.1/24, X the first subnet no address on this machine uses) and N Ray worker nodes,
each in its own network namespace (its own address 10.77.X.(2+i) on a veth pair into the bridge)
and its own mount namespace (a fresh tmpfs on /dev/shm, its own Ray temp dir), run as
`ip netns exec NS unshare --mount sh -c 'mount -t tmpfs ... /dev/shm; exec ray start ... --block'`.
Every node runs with Ray's token auth (a token file made here). A link can be shaped (tc tbf or
htb: rate and burst, both directions), cut and restored (`ip link set ... down/up` on the host end
of its veth), its byte counters read, a whole node killed (every process in its namespace), a node
added to the running cluster (`add_node`) and a path hidden in one node's mount namespace (`hide`).
Each node has its own model cache dir (PDSERVE_MODEL_CACHE); the head's GCS health checks are short.
Everything made here (namespaces, bridge, veths, processes, Ray session dirs) is removed by
`close()`, which the context manager, an atexit hook and a SIGTERM handler all call; it is
idempotent. `unavailable()` says why the harness cannot run here (not root, no `ip`/`unshare`/
`ray`), for a clean skip. What it cannot stand in for: real NICs (a veth is a memory copy in one
kernel), real latency (netem is missing here, so no added delay) and RDMA.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import glob
import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field

from netns_sys import RAY, HarnessError, free_port, kill, restore_env, sh, tree, unavailable  # noqa: F401

LOCK = os.path.join(tempfile.gettempdir(), "pdserve-netns.lock")
# The head's GCS declares a silent node dead after ~4 failed 1 s health checks (Ray's defaults: 5
# failed checks of up to 10 s each, over a minute), so a node lost or cut off for good is replaced
# within seconds; a cut of 3 s (2 failed checks) still leaves the node alive.
HEALTH_CHECK_ENV = {"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "1000",
                    "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "4"}


@dataclass(frozen=True)
class NodeSpec:
    resources: dict = field(default_factory=dict)  # Ray custom resources, e.g. {"decode_node": 1}
    num_cpus: float = 1.0
    rate: str | None = None     # link rate both ways (tc syntax: "200mbit"); None: unshaped
    burst: str = "64kb"         # the shaper's bucket
    shaper: str = "tbf"         # 'tbf' or 'htb'


class NetnsCluster:
    """A Ray head on a bridge and one namespaced Ray node per NodeSpec (see the module docstring)."""

    def __init__(self, nodes: list[NodeSpec], head_cpus: float = 1.0, object_store_mb: int = 100,
                 shm_mb: int = 256, start_timeout_s: float = 90.0):
        self.specs, self.head_cpus, self.start_timeout_s = list(nodes), head_cpus, start_timeout_s
        self.object_store_mb, self.shm_mb = object_store_mb, shm_mb
        self.tag = uuid.uuid4().hex[:6]
        self.bridge = f"pdbr-{self.tag}"
        self.namespaces = [f"pdns-{self.tag}-{i}" for i in range(len(nodes))]
        self.veths = [(f"pv{self.tag}{i}h", f"pv{self.tag}{i}n") for i in range(len(nodes))]
        self.dir = tempfile.mkdtemp(prefix=f"pdns-{self.tag}-")  # short: Ray's socket paths live here
        self.token_path = os.path.join(self.dir, "auth_token")
        self.subnet = ""
        self.port = 0
        self.procs: list[subprocess.Popen] = []
        self._made: list[tuple[str, str]] = []  # ("netns" | "link", name), in creation order
        self._closed = False
        self._saved_sigterm = None
        self._session = contextlib.ExitStack()  # what `connect` set in this process

    # ---- addresses ------------------------------------------------------------------------------
    @property
    def head_ip(self) -> str:
        return f"{self.subnet}.1"

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{self.port}"

    def node_ip(self, i: int) -> str:
        return f"{self.subnet}.{2 + i}"

    def env(self) -> dict:
        """The environment a driver or `pdserve up` needs to join with the token. UCX (NIXL) is
        held to TCP: the nodes share this machine's PID and IPC namespaces, through which UCX would
        otherwise reach another node's memory directly (CMA, SysV shm), past its link."""
        return {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": self.token_path,
                "UCX_TLS": os.environ.get("UCX_TLS", "tcp,self")}

    # ---- start ----------------------------------------------------------------------------------
    def __enter__(self) -> NetnsCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> NetnsCluster:
        why = unavailable()
        if why:
            raise HarnessError(why)
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            self._saved_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            with open(self.token_path, "w", opener=lambda p, f: os.open(p, f, 0o600)) as f:
                f.write(uuid.uuid4().hex + uuid.uuid4().hex)
            with open(LOCK, "w") as lock:  # NOTE: two harnesses at once must not pick one subnet
                fcntl.flock(lock, fcntl.LOCK_EX)
                self.subnet = self._free_subnet()
                self._bridge()
            for i, spec in enumerate(self.specs):
                self._namespace(i, spec)
            self._start_head()
            self._wait_head()
            for i, spec in enumerate(self.specs):
                self._start_node(i, spec)
            return self
        except BaseException:
            self.close()
            raise

    def _on_sigterm(self, signum, frame) -> None:
        self.close()
        raise SystemExit(128 + signum)

    def _free_subnet(self) -> str:
        used = sh("ip", "-o", "-4", "addr", "show")
        for x in range(77, 127):
            if f" 10.{x}." not in used:
                return f"10.{x}.0"
        raise HarnessError("no free 10.X.0.0/24 subnet (X in 77..126) on this machine")

    def _bridge(self) -> None:
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        sh("ip", "addr", "add", f"{self.head_ip}/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")

    def _namespace(self, i: int, spec: NodeSpec) -> None:
        ns, (host, inner) = self.namespaces[i], self.veths[i]
        sh("ip", "netns", "add", ns)
        self._made.append(("netns", ns))
        sh("ip", "link", "add", host, "type", "veth", "peer", "name", inner)
        self._made.append(("link", host))
        sh("ip", "link", "set", inner, "netns", ns)
        sh("ip", "link", "set", host, "master", self.bridge, "up")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.node_ip(i)}/24", "dev", inner)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", inner, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        if spec.rate:
            self.shape(i, spec.rate, spec.burst, spec.shaper)

    def shape(self, i: int, rate: str, burst: str = "64kb", shaper: str = "tbf") -> None:
        """Shape node i's link both ways (replacing any shaping): tc tbf or htb."""
        ns, (host, inner) = self.namespaces[i], self.veths[i]
        for prefix, dev in (((), host), (("ip", "netns", "exec", ns), inner)):
            sh(*prefix, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            if shaper == "tbf":
                sh(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
                   "latency", "100ms")
            elif shaper == "htb":
                sh(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
                sh(*prefix, "tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
                   "rate", rate, "burst", burst)
            else:
                raise ValueError(f"shaper must be 'tbf' or 'htb', got {shaper!r}")

    def unshape(self, i: int) -> None:
        """Node i's link unshaped again, both ways."""
        ns, (host, inner) = self.namespaces[i], self.veths[i]
        for prefix, dev in (((), host), (("ip", "netns", "exec", ns), inner)):
            sh(*prefix, "tc", "qdisc", "del", "dev", dev, "root", check=False)

    def _ray_args(self, temp: str, cpus: float, resources: dict) -> list[str]:
        return ["--num-cpus", f"{cpus:g}", "--resources", json.dumps(resources), "--temp-dir", temp,
                "--object-store-memory", str(self.object_store_mb << 20), "--disable-usage-stats", "--block"]

    def _spawn(self, cmd: list[str], name: str, env: dict | None = None) -> subprocess.Popen:
        log = open(os.path.join(self.dir, f"{name}.log"), "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**self.env(), **(env or {})},
                                start_new_session=True)
        log.close()
        self.procs.append(proc)
        return proc

    def _start_head(self) -> None:
        self.port = free_port()
        cmd = [RAY, "start", "--head", "--node-ip-address", self.head_ip, "--port", str(self.port),
               "--include-dashboard", "false",
               *self._ray_args(os.path.join(self.dir, "head"), self.head_cpus, {})]
        self._spawn(cmd, "head", HEALTH_CHECK_ENV)

    def _wait_head(self, tries: int = 3) -> None:
        """Until the head says it started (within start_timeout_s in all); the nodes join it only
        then. A head whose GCS port was taken between `free_port` and its bind (another test's
        process) starts again on another port, up to `tries` times."""
        end = time.monotonic() + self.start_timeout_s
        while "Ray runtime started" not in self.logs():
            exited = self.procs[0].poll() is not None
            if tries > 1 and self._gcs_port_taken():  # Ray's head itself waits ~40 s to give up
                head = self.procs.pop(0)  # procs held only the head: the nodes start after it
                with contextlib.suppress(ProcessLookupError):  # its group: `ray start` and its services
                    os.killpg(head.pid, signal.SIGKILL)
                head.wait(10)
                shutil.rmtree(os.path.join(self.dir, "head"), ignore_errors=True)
                self._start_head()
                tries -= 1
                continue
            if time.monotonic() > end or exited:
                raise HarnessError(f"the Ray head did not start: {self.logs()}")
            time.sleep(0.1)

    def _gcs_port_taken(self) -> bool:
        for path in glob.glob(os.path.join(self.dir, "head", "session_*", "logs", "gcs_server.*")):
            with open(path, errors="replace") as f:
                if "Failed to start the grpc server" in f.read():
                    return True
        return False

    def _start_node(self, i: int, spec: NodeSpec) -> None:
        ray = " ".join(shlex.quote(a) for a in [
            RAY, "start", "--address", self.address, "--node-ip-address", self.node_ip(i),
            *self._ray_args(os.path.join(self.dir, f"n{i}"), spec.num_cpus, spec.resources)])
        # its own model cache (runtime.model_store), as a machine of its own has: not the shared ~/.cache
        cache = shlex.quote(os.path.join(self.dir, f"cache{i}"))
        script = (f"mount -t tmpfs -o size={self.shm_mb}m tmpfs /dev/shm && "
                  f"PDSERVE_MODEL_CACHE={cache} exec {ray}")
        self._spawn(["ip", "netns", "exec", self.namespaces[i], "unshare", "--mount", "sh", "-c", script],
                    f"n{i}")

    def add_node(self, spec: NodeSpec) -> int:
        """One more namespaced node, on the running cluster (e.g. a spare for replacements, placed
        after the workers so they could not land there); returns its index. Waits until Ray lists
        it alive when this process is connected."""
        import ray

        i = len(self.specs)
        self.specs.append(spec)
        self.namespaces.append(f"pdns-{self.tag}-{i}")
        self.veths.append((f"pv{self.tag}{i}h", f"pv{self.tag}{i}n"))
        self._namespace(i, spec)
        self._start_node(i, spec)
        if ray.is_initialized():
            self.wait_for_nodes(alive_only=True)
        return i

    def wait_for_nodes(self, alive_only: bool = False) -> None:
        """In a driver connected with `ray.init(address=self.address)`: until every node is alive
        (bounded by start_timeout_s); HarnessError with the node logs otherwise."""
        import ray

        end = time.monotonic() + self.start_timeout_s
        want = {self.head_ip, *map(self.node_ip, range(len(self.specs)))}
        while time.monotonic() < end:
            nodes = ray.nodes()
            alive = {n["NodeManagerAddress"] for n in nodes if n["Alive"]}
            if alive_only:  # nodes lost on purpose stay lost: only the others must be up
                want -= {n["NodeManagerAddress"] for n in nodes if not n["Alive"]}
            if want <= alive:
                return
            if not alive_only and any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.25)
        raise HarnessError(f"namespaced Ray nodes did not all come up: {self.logs()}")

    def connect(self) -> None:
        """ray.init in this process, joined to the head with the token (RAY_AUTH_TOKEN_PATH and
        Ray's cached auth mode are set until `disconnect`); waits for every node."""
        import ray

        from deploy.ray_guard import auth_env

        end = time.monotonic() + self.start_timeout_s
        saved = os.environ.get("RAY_AUTH_TOKEN_PATH")
        os.environ["RAY_AUTH_TOKEN_PATH"] = self.token_path
        self._session.callback(restore_env, "RAY_AUTH_TOKEN_PATH", saved)
        self._session.enter_context(auth_env("token"))
        self._session.callback(ray.shutdown)
        while True:
            try:
                ray.init(address=self.address, log_to_driver=False)
                break
            except (ConnectionError, RuntimeError) as e:
                if time.monotonic() > end or self.procs[0].poll() is not None:
                    raise HarnessError(f"cannot join {self.address}: {e}; {self.logs()}") from None
                time.sleep(0.5)
        self.wait_for_nodes()

    def disconnect(self) -> None:
        """ray.shutdown in this process and the environment as it was before `connect`."""
        self._session.close()

    def logs(self, tail: int = 2000) -> str:
        out = []
        for name in ["head", *(f"n{i}" for i in range(len(self.specs)))]:
            try:
                with open(os.path.join(self.dir, f"{name}.log")) as f:
                    out.append(f"--- {name}:\n{f.read()[-tail:]}")
            except OSError:
                pass
        return "\n".join(out)

    # ---- faults and counters ----------------------------------------------------------------------
    def link(self, i: int, up: bool) -> None:
        """Cut (up=False) or restore node i's link, at the host end of its veth."""
        sh("ip", "link", "set", self.veths[i][0], "up" if up else "down")

    def link_bytes(self, i: int) -> dict[str, int]:
        """Bytes the node sent (`from_node`) and received (`to_node`), from the host veth counters."""
        def read(what: str) -> int:
            with open(f"/sys/class/net/{self.veths[i][0]}/statistics/{what}") as f:
                return int(f.read())
        return {"from_node": read("rx_bytes"), "to_node": read("tx_bytes")}

    def kill_node(self, i: int) -> None:
        """Every process in node i's network namespace dies at once (SIGKILL)."""
        pids = [int(p) for p in sh("ip", "netns", "pids", self.namespaces[i], check=False).split()]
        kill(pids, deadline_s=0.0)

    def hide(self, i: int, path: str) -> bool:
        """An empty tmpfs over `path` in node i's mount namespace only (its Ray processes and the
        workers they start no longer see what is there: a machine that lacks those files). False
        when the node has no process left (killed)."""
        own = os.readlink("/proc/self/ns/mnt")
        for pid in sh("ip", "netns", "pids", self.namespaces[i], check=False).split():
            try:
                if os.readlink(f"/proc/{pid}/ns/mnt") == own:
                    continue
            except OSError:
                continue
            sh("nsenter", "--target", pid, "--mount", "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", path)
            return True
        return False

    # ---- cleanup ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove everything this harness made; idempotent, never raises."""
        if self._closed:
            return
        self._closed = True
        try:
            self.disconnect()
        except Exception:  # noqa: BLE001 (cleanup goes on whatever a Ray shutdown says)
            pass
        pids = [p for proc in self.procs for p in tree(proc.pid)]
        for ns in self.namespaces:  # anything left in our namespaces is ours
            pids += [int(p) for p in sh("ip", "netns", "pids", ns, check=False, timeout=5).split()]
        kill(pids)
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for kind, name in reversed(self._made):
            if kind == "netns":
                sh("ip", "netns", "del", name, check=False, timeout=10)
            else:
                sh("ip", "link", "del", name, check=False, timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._saved_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._saved_sigterm)
        atexit.unregister(self.close)
