"""The prefill/decode coordinator (MindIE MS's `ms_coordinator`): the data-plane entry of a PD
cluster. It assigns P and D roles from a static instance list, forwards each request to a P with the
PD headers, keeps one `GET /dresult` stream per D, and relays P's first output and then D's records
to the client.

Nothing here imports torch, `mindie._C` or the engine: the coordinator only routes bytes.
"""
