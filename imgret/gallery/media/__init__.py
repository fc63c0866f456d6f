"""Image bytes, stored by content hash beside the rows that refer to them.

- ``files``: the content-addressed folder of image files, written atomically;
- ``blobs``: the ``media_blobs`` store in the database, the choice between the two, and
  moving a gallery from one to the other;
- ``gc``: removing bytes no row refers to, after a delete and at start-up.
"""
