"""Layer: structured outputs: grammar-constrained decoding with llguidance.

- `grammar.py` turns a request's StructuredOutputsParams into a compiled llguidance matcher
  (JSON schema, any JSON object, regex, choice, Lark/GBNF grammar) in a small thread pool,
  off the step thread, within documented limits, cached by constraint, and says in plain
  words why a constraint is invalid, too large or unsupported.
- `decoding.py` keeps one matcher per constrained sequence on the host, fills the packed token
  bitmask of every constrained row each step (the sampler applies it on device, see
  jserve.runtime.sampler), advances the matchers with the sampled tokens and keeps them exact
  across preemption.

jserve.core never imports this package; the engine (jserve.engine) is its only user.
"""
