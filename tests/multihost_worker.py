"""One process of a two-process run under ``jax.distributed`` (run by tests/test_sharding.py): each
process holds 2 CPU devices, the mesh (data=2, model=2) spans both, and process 0 prints the
generated tokens as JSON.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 NPROC=16 \
        python tests/multihost_worker.py PROCESS_ID NUM_PROCESSES PORT

(test_sharding.py sets both from helpers.xla_env.)
"""

import json
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
process, processes, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}", num_processes=processes, process_id=process
)

from multihost_model import PROMPTS, SETTINGS, model  # noqa: E402

import kvjax  # noqa: E402

mesh = kvjax.make_mesh("data=2,model=2")
params = kvjax.shard(model(), mesh)
out = {
    name: [
        row.tolist()
        for row in kvjax.generate(params, PROMPTS, 6, stop_ids=(), mesh=mesh, **options)
    ]
    for name, options in SETTINGS.items()
}
if process == 0:
    print(
        json.dumps(
            {"devices": jax.device_count(), "local": jax.local_device_count(), "tokens": out}
        )
    )
jax.distributed.shutdown()
