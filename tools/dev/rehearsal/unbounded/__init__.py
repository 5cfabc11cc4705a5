"""Not imported as a package: this folder goes on the PYTHONPATH of the
rehearsal's ``mtp-as-main`` run, where its ``sitecustomize`` applies."""
