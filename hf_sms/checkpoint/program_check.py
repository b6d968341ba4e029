"""A ``torch.export`` archive (``model.pt2``) checked before ``torch.export.load`` reads it.

``torch.export.load`` unpickles some entries of an archive (a weight or constant marked ``use_pickle``, a legacy
``data/weights/model.pt``, the sample inputs, custom and opaque objects) and loads AOTInductor libraries, so a
crafted file runs code (torch's own docstring: never load untrusted data). hf-sms writes programs that hold none of
them (no sample inputs either: :mod:`hf_sms.checkpoint.plain`), and :func:`check_program`, which the model card
gives word for word (the standard library only: no hf-sms), refuses any archive that holds anything else.
"""

import json
import re
import zipfile


def check_program(path):
    """Raise ValueError unless the torch.export archive at path holds only a program: its JSON and raw tensors."""
    plain = re.compile(
        r"archive_format|archive_version|byteorder|\.data/(version|serialization_id)|models/model\.json"
        r"|data/weights/model_weights_config\.json|data/constants/model_constants_config\.json"
        r"|data/weights/weight_\d+|data/constants/tensor_\d+|data/sample_inputs/model\.pt"
    )
    with zipfile.ZipFile(path) as archive:
        infos = archive.infolist()
        names = [info.filename for info in infos]
        if len({name.split("/")[0] for name in names}) != 1 or len(set(names)) != len(names):
            raise ValueError(f"{path} is not one torch.export archive: do not load it")
        for info in infos:
            name = info.filename.split("/", 1)[-1]
            if not plain.fullmatch(name) or (name.endswith(".pt") and info.file_size):  # a .pt entry is a pickle
                raise ValueError(f"{path} holds {name}, which torch.export.load would unpickle or run: do not load it")
            if name.endswith("_config.json"):
                for key, entry in json.loads(archive.read(info))["config"].items():
                    if entry.get("use_pickle") is not False or not re.fullmatch(
                        r"(weight|tensor)_\d+", str(entry.get("path_name"))
                    ):
                        raise ValueError(f"{path} stores {key!r} as a pickle, which could run code: do not load it")
