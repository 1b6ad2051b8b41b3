"""What runs inside vLLM's worker process: the taps (:mod:`.taps`), the per-step placement
(:mod:`.arena`), the shared-memory hand-off (:mod:`.handoff`, whose client half the verbs import;
the files it keeps ready between calls: :mod:`.spares`), how each step of a graph engine runs —
whole graph, graph pieces serving an nnsight trace, or eager (:mod:`.pieces`) — and the runner and
worker classes vLLM is given (:mod:`.runner`, :mod:`.gpu`, :mod:`.cpu`)."""
