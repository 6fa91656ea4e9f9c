"""Helpers of ``mooncake.structured_object_store``.

* ``infer``: codec inference for columns of Python values and the recursive expansion of
  dict/list rows into leaves and nodes;
* ``codecs``: the column codecs (their payload layouts are upstream's, so either side can
  read what the other wrote);
* ``bundle``: the bundle layout in the store (manifest, meta and buffer keys, chunks).
"""
