"""relprop inside the tools people already explain language models and graph neural networks with.

- :mod:`relprop.integrations.inseq`: importing it registers ``relprop_attnlrp``, ``relprop_cp_lrp`` and
  ``relprop_epsilon`` among inseq's attribution methods (``inseq.load_model(model, "relprop_attnlrp")``).
- :mod:`relprop.integrations.captum`: :class:`~relprop.integrations.captum.LLMRelevance`, the method captum's
  ``LLMGradientAttribution`` takes.
- :mod:`relprop.integrations.pyg`: :class:`~relprop.integrations.pyg.LRPExplainer`, an explainer algorithm of
  PyTorch Geometric's ``torch_geometric.explain``.

Each module imports its tool when it is imported (inseq, captum and PyG are optional); this package imports none.
"""
