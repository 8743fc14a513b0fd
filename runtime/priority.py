"""A worker's CPU priority. Ray starts its worker processes at nice 15 (its `worker_niceness`), so
on a busy node every engine runs below the coordinator, the HTTP server, a load generator and any
other process at nice 0 (a nice-0 process gets about 28 times the CPU of a nice-15 one when both
want it). `ClusterConfig.worker_niceness` lets a worker set its own nice value at start, on every
thread it has (Linux keeps a nice value per thread; threads started later inherit it). It is off
by default: on the development machine's 2 cores, engines at 0 served no better than at 15,
because the coordinator every token passes through then waits for them (docs/planner.md). Raising
priority needs CAP_SYS_NICE or an RLIMIT_NICE that allows it: where neither does, the worker keeps
Ray's value and says so once (a local Ray started with RAY_worker_niceness=0 in the environment
starts its workers at 0 with no privilege). /v1/cluster shows each worker's nice value.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def set_niceness(target: int | None) -> int:
    """Every thread of this process to nice `target` (None: leave it); the value in effect after."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if target is None or target == current:
        return current
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]  # not Linux: the calling thread (a process there)
    try:
        for tid in tids:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, target)
            except ProcessLookupError:  # that thread ended meanwhile
                pass
    except PermissionError:
        log.warning("this worker runs at nice %d: raising it to %d needs CAP_SYS_NICE (or RLIMIT_NICE); "
                    "its engine gets less CPU than the processes around it when the node is busy",
                    current, target)
    return os.getpriority(os.PRIO_PROCESS, 0)


def pin_to_cpu(cpu: int | None) -> list[int] | None:
    """Every thread of this process onto CPU `cpu` (None: leave the affinity); the CPUs the process
    may run on after (None where the OS has no sched_setaffinity). A worker that owns one core, as
    a GPU worker owns its device, so prefill and decode do not contend in ways a GPU cluster would
    not (bench serve pins each worker to its own core). A CPU this process may not use (outside its
    cgroup, or missing) is refused with a warning and the affinity left as it was. Threads started
    later inherit it."""
    if not hasattr(os, "sched_setaffinity"):
        if cpu is not None:
            log.warning("this OS cannot pin threads to CPUs: worker left unpinned (asked for CPU %d)", cpu)
        return None
    if cpu is not None:
        allowed = os.sched_getaffinity(0)
        if cpu not in allowed:
            log.warning("CPU %d is not among the CPUs this worker may use (%s): left unpinned", cpu,
                        sorted(allowed))
            return sorted(allowed)
        try:
            tids = [int(t) for t in os.listdir("/proc/self/task")]
        except OSError:
            tids = [0]
        for tid in tids:
            try:
                os.sched_setaffinity(tid, {cpu})
            except (ProcessLookupError, PermissionError):  # ended meanwhile, or a thread we may not move
                pass
    return sorted(os.sched_getaffinity(0))
