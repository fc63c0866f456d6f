"""Who owns what and who may call what.

- ``collections``: named galleries in one database, each with its own items, query sets,
  versions and keys' roles; created, made private, deleted with all they hold;
- ``keys``: API keys with a role per collection, stored as salted digests.
"""
