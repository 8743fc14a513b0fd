"""Deterministic simulation testing (DST) of the KV migration protocol and the ownership ledger.

One process, one virtual clock, one simulated network: prefill and decode workers drive the real
sans-IO sender steps (`transfer.session.SenderSession.*_steps`) and the real receiver
(`transfer.receiver.MessageReceiver`) over the real allocators and pools (`kvcache`), and the
coordinator is production's core (`coordinator.core.ClusterCore`: routing, the ledger and its
reconciler, failover) under a simulated driver (`dst.coordinator`). The network and the faults
are what one transport declares (`dst.guarantees`, from its `transfer.registry` Guarantees). A
seed decides everything: latencies, which pending message goes next, and the faults
(`dst.faults`). Invariants are checked after every step
(`dst.invariants`); a failing seed prints the one-line command that replays it and its fault
schedule shrunk to a minimal one (`dst.run`).
Test-only mutants re-introduce known bugs to prove the simulator finds them (`dst.mutants`);
`dst.explore` enumerates every delivery order and fault placement of small cases.

Named `dst` because "simulator" already names the allocator simulator and the planner's DES.
"""
