"""How policy N goes from the trainer to every inference server: one interface, one module per kind.

- `file.py`: a Hugging Face directory per policy under `<run>/policies/`; the orchestrator has every server
  load it (pause, `/update_weights`, resume). Any server that speaks the contract takes it, vLLM included.
- `broadcast.py`: trainer rank 0 sends each tensor to every server over torch.distributed (NCCL across GPUs,
  gloo on CPU); the trainer waits until every server serves it.
- `shared.py`: trainer rank 0 keeps one flat buffer of the whole policy that the servers on its node map (CUDA
  IPC on the trainer's GPU, POSIX shared memory on CPU), so trainer and server may share one GPU; the trainer
  fills it and offers the policy, then goes on training while the servers copy it in.

Both in-memory kinds share one control plane (`control.py`: rendezvous, offers, answers, deadlines) and one
orchestrator follower (`follower.py`); the servers' end is `tandem.inference.weights_receiver`. Whatever the
kind, the final policy is written as a directory: it is the run's result.

The interface is `base.py` (`WeightPublisher`, `PolicyFollower`, `PolicySource`). The trainer's end is built by
`tandem.trainer.publish.make_publisher`, which hands a `PolicySource` over, so this package never imports the
trainer's modules (the inference server imports it); the orchestrator's by `follower.make_follower`.
"""
