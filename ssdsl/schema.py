"""The version of every JSON document and JSON Lines record ssdsl prints or writes.

Raise it when a field is renamed or removed, or changes meaning; adding a field keeps it.
docs/json.md describes the documents of each version.
"""

SCHEMA_VERSION = 1
