"""Weight broadcast into a running SGLang server: runs INSIDE SGLang's scheduler process.

SGLang's own broadcast (`/init_weights_update_group` + `/update_weights_from_distributed`) builds
its group through torch's process-group helper, whose rendezvous keys (`<group>/<group>//cpu//…`)
differ from the private group `factory.model.weightsync` builds on the trainer (`factory-weights/…`), so
the two sides never meet. Instead, the two functions below are SGLang *custom weight loaders*
(server flag `--custom-weight-loader`), called through `/update_weights_from_tensor` with
`load_format=<their import path>`; they join the trainer's group with `factory.model.weightsync`'s own
receiver and load what it receives with the model's `load_weights` — the same role vLLM's worker
extension plays. Only torch and factory.model.weightsync are imported here (SGLang's venv has no more
of factory's dependencies).

That endpoint only takes named tensors (pickled; its unpickler allows torch types only), so the
arguments travel as JSON in the *name* of one empty tensor (see `factory.rollout.sglang._call_payload`).
"""

from __future__ import annotations

import json

_receiver = None  # one weight group per server process


def join_group(model, named_tensors) -> None:
    """Join the trainer's weight group (blocks until every rank has joined)."""
    from factory.model.weightsync import WeightReceiver

    global _receiver
    args = json.loads(named_tensors[0][0])
    _receiver = WeightReceiver(args["host"], args["port"], args["rank"], args["world_size"], args["plan_json"],
                               local_host=args["local_host"], backend=args["backend"])


def receive(model, named_tensors) -> None:
    """Receive one broadcast of every bucket and load it into the model."""
    if _receiver is None:
        raise RuntimeError("receive before join_group: the engine has not joined the trainer's weight group")
    model.load_weights(_receiver.receive())
