"""The wire contract between tandem's processes, imported by both ends of every HTTP hop: the inference servers
(built-in and vLLM) on one side, the orchestrator and `tandem eval`'s client on the other.

- `protocol.py`: the request and response models of `/generate`, the admin routes and the OpenAI subset
  (pydantic only);
- `kept_ids.py`: the kept ids of truncated sampling as short strings, encoded and decoded (standard library only);
- `token_generate.py`: vLLM's token route `/inference/v1/generate` in `renderers`' shape, translated to and
  from `/generate`;
- `codec.py`: the msgpack bodies of `/generate` (one encoder, one safe decoder) and the `x-queue-depth` header.

None of it imports torch or another tandem package, so a client speaks the contract without the engine, and the
engine without the orchestrator. Nothing is imported here: `import tandem.wire.kept_ids` loads that module only.
"""
