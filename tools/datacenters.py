"""Datacenters on real sockets on one machine: one Linux network namespace per datacenter, one for the
lighthouse, joined by a bridge in a namespace of its own, each datacenter's egress limited by the
kernel's `tbf` qdisc. Needs root and iproute2 (`ip`, `tc`); `netem` is not assumed, so latency stays
emulated by `muloco.link`.

    with Datacenters(["200mbit", "200mbit", "50mbit"]) as dcs:   # datacenters 0, 1, 2
        dcs.spawn(dcs.sites[0], ["python", ...], log)              # a process inside datacenter 0
        dcs.cut(dcs.sites[2]); ...; dcs.restore(dcs.sites[2])     # its link down, then up again

Site k's interface `eth0` has address 10.58.0.(10+k) (the lighthouse's: 10.58.0.2) on one /24 that
exists only inside these namespaces: they have no route out and no link to the host's interfaces, so
no packet leaves them. Every namespace, link and process made here is recorded and removed on exit,
on SIGINT/SIGTERM, or on a failure half-way through the setup; a namespace name already in use is
refused, never touched (names carry this process's id: `muloco-dc-<pid>-<site>`).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX = "muloco-dc"
SUBNET = "10.58.0"
LIGHTHOUSE_HOST = 2
FIRST_DATACENTER_HOST = 10
INTERFACE = "eth0"  # each site's end of its link, inside its namespace
TBF_LATENCY = "50ms"  # the limiter's queue: a packet waiting longer is dropped (a router's buffer)
BURST_SECONDS = 0.01  # the limiter's bucket: 10 ms of the rate (at least a few full frames)
MIN_BURST_BYTES = 32 * 1024


class NetworkError(RuntimeError):
    """A setup step the kernel refused (the message is one line naming it)."""


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux's (this is {sys.platform})"
    missing = [tool for tool in ("ip", "tc", "ss") if shutil.which(tool) is None]
    if missing:
        return f"iproute2's {', '.join(missing)} not found"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    return None


def rate_bits(rate: str) -> float:
    """tc's rate text ("200mbit", "1gbit", "500kbit") in bits per second."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            number = rate[:-len(unit)]
            try:
                return float(number) * scale
            except ValueError:
                break
    raise NetworkError(f"rate {rate!r} is not NUMBER followed by kbit, mbit or gbit")


def _run(argv: list[str], what: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        why = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}").splitlines()[0]
        raise NetworkError(f"{what}: {why}")
    return done.stdout


@dataclass(frozen=True)
class Site:
    name: str  # "lighthouse", "dc0", "dc1", ...
    namespace: str
    address: str
    bridge_port: str  # its link's other end, on the bridge
    rate: str | None  # its egress limit (None: unlimited)


class Datacenters:
    """The namespaces and links of one rehearsal (a context manager: torn down on exit)."""

    def __init__(self, rates: list[str | None], tag: str | None = None):
        why = unavailable()
        if why:
            raise NetworkError(f"cannot make datacenters here: {why}")
        for rate in rates:
            if rate is not None:
                rate_bits(rate)
        tag = tag or str(os.getpid())
        self.bridge_namespace = f"{PREFIX}-{tag}-bridge"
        self.sites = [Site(f"dc{k}", f"{PREFIX}-{tag}-{k}", f"{SUBNET}.{FIRST_DATACENTER_HOST + k}", f"dc{k}", rate)
                      for k, rate in enumerate(rates)]
        self.lighthouse = Site("lighthouse", f"{PREFIX}-{tag}-lighthouse", f"{SUBNET}.{LIGHTHOUSE_HOST}",
                               "lighthouse", None)
        self.made: list[str] = []  # namespaces this object made, in order
        self.processes: list[subprocess.Popen] = []
        self._handlers: dict[int, object] = {}

    # -- setup and teardown ---------------------------------------------------------------------

    def __enter__(self) -> Datacenters:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._set_up()
        except BaseException:
            self.tear_down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.tear_down()

    def _on_signal(self, signum, frame) -> None:
        self.tear_down()
        raise SystemExit(128 + signum)

    def _set_up(self) -> None:
        existing = set(_run(["ip", "netns", "list"], "listing namespaces").split())
        wanted = [self.bridge_namespace] + [s.namespace for s in (self.lighthouse, *self.sites)]
        taken = [name for name in wanted if name in existing]
        if taken:
            raise NetworkError(f"network namespace {taken[0]} is already in use (left by another rehearsal?); "
                               f"not touching it: remove it with `ip netns del {taken[0]}` if it is yours")
        for namespace in wanted:
            _run(["ip", "netns", "add", namespace], f"making namespace {namespace}")
            self.made.append(namespace)
            _run(["ip", "-n", namespace, "link", "set", "lo", "up"], f"{namespace}: loopback up")
        bridge = ["ip", "-n", self.bridge_namespace]
        _run([*bridge, "link", "add", "br0", "type", "bridge"], "making the bridge")
        _run([*bridge, "link", "set", "br0", "up"], "bridge up")
        for site in (self.lighthouse, *self.sites):
            # Both ends are made inside their namespaces: no name in the host's own namespace is used.
            _run(["ip", "-n", site.namespace, "link", "add", INTERFACE, "type", "veth", "peer", "name",
                  site.bridge_port, "netns", self.bridge_namespace], f"{site.name}: making its link")
            _run([*bridge, "link", "set", site.bridge_port, "master", "br0", "up"], f"{site.name}: link to the bridge")
            inside = ["ip", "-n", site.namespace]
            _run([*inside, "addr", "add", f"{site.address}/24", "dev", INTERFACE], f"{site.name}: its address")
            _run([*inside, "link", "set", INTERFACE, "up"], f"{site.name}: link up")
            if site.rate is not None:
                self.set_rate(site, site.rate)

    def set_rate(self, site: Site, rate: str) -> None:
        """Limit `site`'s egress to `rate` (tc's units: "200mbit")."""
        burst = max(MIN_BURST_BYTES, int(rate_bits(rate) / 8 * BURST_SECONDS))
        _run(["ip", "netns", "exec", site.namespace, "tc", "qdisc", "replace", "dev", INTERFACE, "root", "tbf",
              "rate", rate, "burst", str(burst), "latency", TBF_LATENCY],
             f"tc (the kernel's rate limiter) refused rate {rate!r} for {site.name}")

    def tear_down(self) -> None:
        """Kill every process started here and in these namespaces, then remove the namespaces (their
        links go with them). Safe to call twice."""
        for proc in self.processes:
            _kill_group(proc)
        for namespace in self.made:
            for pid in subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.processes:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for namespace in reversed(self.made):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        self.made, self.processes = [], []
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)
        self._handlers = {}

    # -- using them ------------------------------------------------------------------------------

    def spawn(self, site: Site, argv: list[str], log: Path, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen:
        """Start `argv` inside `site`'s namespace, in a process group of its own, output to `log`."""
        with open(log, "w") as sink:
            proc = subprocess.Popen(["ip", "netns", "exec", site.namespace, *argv], env=env, cwd=cwd, stdout=sink,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        _kill_group(proc, sig)

    def cut(self, site: Site) -> None:
        """Take `site`'s link down (its bridge end: the site's own interface keeps its address)."""
        _run(["ip", "-n", self.bridge_namespace, "link", "set", site.bridge_port, "down"], f"cutting {site.name}")

    def restore(self, site: Site) -> None:
        _run(["ip", "-n", self.bridge_namespace, "link", "set", site.bridge_port, "up"], f"restoring {site.name}")

    def sockets(self, site: Site) -> list[tuple[str, str, str]]:
        """The TCP sockets inside `site`: (state, local address:port, peer address:port)."""
        out = _run(["ip", "netns", "exec", site.namespace, "ss", "-Htan"], f"{site.name}: ss")
        rows = []
        for line in out.splitlines():
            fields = line.split()
            if len(fields) >= 5:
                rows.append((fields[0], fields[3], fields[4]))
        return rows

    def sent_bytes(self, site: Site) -> int:
        """Bytes `site` has sent on its link (its interface's counter)."""
        out = _run(["ip", "netns", "exec", site.namespace, "cat", f"/sys/class/net/{INTERFACE}/statistics/tx_bytes"],
                   f"{site.name}: its counters")
        return int(out)


def leftovers(tag: str) -> list[str]:
    """Namespaces of the rehearsal `tag` still present (none after a clean teardown)."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return [name for name in names if name.startswith(f"{PREFIX}-{tag}-")]


def _kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass


def wait_until(done, timeout_s: float, what: str, poll_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)
