"""The retrieval experiment (`train --config retrieval`): passkey probes (`passkey`), the copy curve measured while
training (`copy_curve`), the experiment itself (`experiment`), seeds pooled (`retrieval_seeds`), its tables and
figure (`retrieval_results`) and the diagnosis of a finished run (`retrieval_diagnosis`)."""
