"""Rollout: Ray-spawned vLLM engines that generate groups of samples and take new weights in place.

On trainer rank 0::

    manager = RolloutManager(EngineLaunchConfig(model_path=hf_dir, engines=RolloutEngineConfig(num_engines=2)))
    manager.submit("uid-0", prompt_token_ids, SamplingParams(n=8, temperature=1.0, max_tokens=512, seed=0))
    for group in manager.completed():          # streamed as each prompt's n samples finish
        ...                                    # group.samples[i].token_ids / .logprobs / .finish_reason
    manager.cancel_all()                       # drop what is still outstanding
    manager.sync_weights(named_tensors)        # all HF-named tensors from this rank

With pipeline parallelism every stage sends its own layers: rank 0 calls `begin_weight_sync()`, broadcasts
`sender_spec()`, every rank runs `WeightSender(spec).send(iter_hf_weights(model, hf_config))`, and after a barrier
rank 0 calls `finish_weight_sync()` (see `weight_sync`; `send_from_pipeline_stages` does the middle step and orders
the stages for the collective transport), which returns the engines' reload reports; `sync_probe(prompts, max_tokens)`
then has every engine continue fixed prompts greedily, outside the outstanding requests, for the trainer's sync check
(`sync_check`). `rollout.weight_transport` picks how bytes travel: /dev/shm files
("shm", engines on the sender's node) or a gloo/NCCL group between each sending rank and every engine worker
("collective", engines on any node); "auto" chooses.

`rollout.mode` picks where engines run (`modes.build_rollout_manager`): Ray actors (above), running
`megatron-cpo rollout` HTTP servers (`server.py`, client `server_client.ServerRolloutManager`), or engine servers
colocated on the trainer's devices (`colocate.py`); all three share the manager interface shown here.
Names load on first use, so that loading a config (which reads `config.py` here) imports no torch.
"""
from megatron_cpo.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "manager": ("RolloutManager",),
    "config": ("RolloutEngineConfig",),
    "types": ("EngineLaunchConfig", "RolloutEngineStartError", "RolloutEnginesLostError", "RolloutGroup",
              "RolloutSample", "SamplingParams", "derive_sample_seeds"),
    "collective": ("WeightGroupJoinError",),
    "weight_sync": ("WeightSender", "WeightSenderSpec", "close_weight_groups", "send_from_pipeline_stages"),
})
