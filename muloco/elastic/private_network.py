"""A network of the lighthouse's own, so that torchft's lighthouse port is reachable by its gateway only.

torchft's lighthouse (0.2.0) binds a TCP address and admits whoever connects; on the host's loopback,
any process on the host reaches it. Linux gives a process a loopback nobody else shares: a network
namespace, which an unprivileged process may create inside a user namespace of its own. The lighthouse
process opens the gateway's public socket first (a socket stays in the network it was opened in), then
moves into a fresh user and network namespace, brings its loopback up and starts torchft's lighthouse
there: the gateway's connections to it, opened from inside, are then the only ones that can reach it.

The kernel may refuse (user namespaces disabled, a container's seccomp policy, a process that already
runs threads, not Linux): the lighthouse then stays on the host's loopback and says so; the workers
still count only the quorum members the job secret signed, and log the others
(muloco/elastic/authentic_quorum.py).
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct
import sys

_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = "16sH14x"  # struct ifreq: the interface's name, then its flags


def enter_private_network() -> str | None:
    """Move this process into a new user and network namespace whose loopback is up. None when it did,
    else why not (the process is then where it was). Only a single-threaded process can: call it before
    anything starts a thread. OSError: the namespaces were made but could not be set up (the process is
    in them; it should stop)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux's ({sys.platform})"
    uid, gid = os.getuid(), os.getgid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        return f"unshare(CLONE_NEWUSER | CLONE_NEWNET): {os.strerror(err)}" + (
            " (user namespaces disabled, or a process that runs threads)" if err in (errno.EPERM, errno.EINVAL) else "")
    # The same ids inside as outside (unmapped, the process could create no file); setgroups must be
    # denied before an unprivileged process may map its group.
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # a socket of the new network
        flags = struct.unpack(_IFREQ, fcntl.ioctl(probe, _SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0)))[1]
        fcntl.ioctl(probe, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))
    return None
