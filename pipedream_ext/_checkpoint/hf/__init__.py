"""The ``"hf"`` format: Hugging Face model directories (weights only, no manifest).

``storage`` (``HfStorage``, its row of the format table), ``files`` (the index,
reading one rank's share), ``load``, ``save`` (``save_pretrained``) and
``directory`` (writing into the user's directory without losing what is in it).
"""
