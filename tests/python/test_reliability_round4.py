"""Round 4 of the hostile review (issue 43): what the Python doors did after a refusal, and
outputs checked before the work that produces them. Each test failed on the code before the
change (docs/bad_inputs.md, "Reliability, round four")."""
import os

import pytest

torch = pytest.importorskip("torch")

import mixprec.torch as mt
from test_advise import Three

torch.set_num_threads(1)
nn = torch.nn


def test_r4_a_refused_telemetry_leaves_no_run_folder(tmp_path):
    """Refused after the core made the folder (was: the folder stayed, holding config.json and
    the log, and the retry was refused as "exists and is not empty")."""
    convs = nn.Sequential(nn.Conv1d(1, 1, 1))  # no Linear: nothing for the advisor to sample
    out = tmp_path / "run"
    with pytest.raises(ValueError):
        mt.Telemetry(convs, str(out), advisor_every=1)
    assert not out.exists()
    assert not convs[0]._forward_hooks  # no hook left on the model
    mt.Telemetry(convs, str(out)).close()  # the retry is taken

    # A TensorBoard folder that cannot be made (under a file).
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    out2 = tmp_path / "run2"
    with pytest.raises(Exception):
        mt.Telemetry(nn.Linear(2, 2), str(out2), tensorboard=str(a_file / "tb"))
    assert not out2.exists()

    # An empty folder the user made is kept, and left empty.
    out3 = tmp_path / "run3"
    out3.mkdir()
    with pytest.raises(ValueError):
        mt.Telemetry(convs, str(out3), advisor_every=1)
    assert out3.is_dir() and list(out3.iterdir()) == []
    mt.Telemetry(convs, str(out3)).close()


@pytest.mark.parametrize("case", ["missing_folder", "a_folder", "fifo", "symlink", "same_as_evidence"])
def test_r4_advise_outputs_are_checked_before_any_step(tmp_path, case):
    """advise(out=...) refused after every step ran lost them (was: the steps ran, then the
    write failed)."""
    out = tmp_path / "recipe.json"
    kw = {}
    if case == "missing_folder":
        out = tmp_path / "no" / "recipe.json"
        match = "its folder .* does not exist"
    elif case == "a_folder":
        out = tmp_path
        match = "is a folder; expected a new file name or a regular file"
    elif case == "fifo":
        os.mkfifo(out)
        match = r"is a FIFO \(named pipe\)"
    elif case == "symlink":
        os.symlink(tmp_path / "elsewhere.json", out)
        match = "is a symbolic link"
    else:
        kw["evidence"] = out
        match = "is also out"
    ran = []
    model = Three()
    with pytest.raises(ValueError, match=match):
        mt.advise(model, lambda: ran.append(1), steps=1, out=out, **kw)
    assert ran == []
