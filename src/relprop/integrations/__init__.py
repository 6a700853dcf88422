"""relprop inside the tools people already explain language models with.

- :mod:`relprop.integrations.inseq`: importing it registers ``relprop_attnlrp``, ``relprop_cp_lrp`` and
  ``relprop_epsilon`` among inseq's attribution methods (``inseq.load_model(model, "relprop_attnlrp")``).
- :mod:`relprop.integrations.captum`: :class:`~relprop.integrations.captum.LLMRelevance`, the method captum's
  ``LLMGradientAttribution`` takes.

Each module imports its tool when it is imported (inseq and captum are optional); this package imports neither.
"""
