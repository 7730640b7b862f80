"""From zero to a real phone call (issue 16): `kame-phone twilio setup` and `kame-phone dial`, run as the real
commands against a local stand-in for Twilio's REST API; `.env`; what serve says at start; the call status
callback. The dialed call is driven by the stand-in through the service's real webhook and media stream."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
from pathlib import Path

import aiohttp
import pytest

from knowledge.agents import AgentDirectory
from knowledge.backend import BackendConfig, BackendServices
from telephony.config import ServiceConfig
from telephony.server import CALL_STATUS_PATH

from .phone_fixtures import flite_wav, metric, running_phone, write_agents
from .twilio_rest_server import TwilioRestStandIn, serve_twilio_rest

ROOT = Path(__file__).resolve().parents[1]
ACCOUNT = "AC" + "4" * 32
SECRET = "rest-secret-token"
NUMBER = "+15550002222"


async def _kame(args: list[str], env: dict[str, str], cwd: Path = ROOT) -> tuple[int, str, str]:
    """Run the real `kame-phone` command (in its own process) while this loop serves the stand-ins."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TWILIO_", "PUBLIC_URL", "ADMIN_TOKEN"))}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kame_phone.cli", *args, cwd=cwd, env={**clean, "PYTHONPATH": str(ROOT), **env},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def _rest_env(twilio: TwilioRestStandIn, token: str = SECRET) -> dict[str, str]:
    return {"TWILIO_ACCOUNT_SID": ACCOUNT, "TWILIO_AUTH_TOKEN": token, "TWILIO_API_BASE_URL": twilio.base_url}


async def test_twilio_setup_points_the_number_at_the_service(tmp_path: Path) -> None:
    async with serve_twilio_rest(ACCOUNT, ACCOUNT, SECRET) as twilio:
        twilio.add_number(NUMBER, voice_url="https://demo.twilio.com/welcome/voice/")
        env = {**_rest_env(twilio), "PUBLIC_URL": "https://voice.example.com"}
        # --dry-run says what would change and changes nothing.
        rc, out, err = await _kame(["twilio", "setup", "--number", NUMBER, "--dry-run"], env)
        assert rc == 0, err
        assert "https://demo.twilio.com/welcome/voice/ [POST] -> https://voice.example.com/twilio/voice [POST]" in out
        assert "nothing changed" in out and not twilio.number_updates
        # --public-url over a .env still holding the example's PUBLIC_URL: that one is not used, so not refused.
        example = {**env, "PUBLIC_URL": "https://replace-with-your-public-host"}
        rc, out, err = await _kame(["twilio", "setup", "--number", NUMBER, "--dry-run", "--public-url",
                                    "https://voice.example.com"], example)  # fmt: skip
        assert rc == 0 and "-> https://voice.example.com/twilio/voice [POST]" in out, err
        rc, out, err = await _kame(["twilio", "setup", "--number", NUMBER], env)
        assert rc == 0, err
        assert twilio.number_updates == [{
            "VoiceUrl": "https://voice.example.com/twilio/voice", "VoiceMethod": "POST",
            "StatusCallback": "https://voice.example.com" + CALL_STATUS_PATH, "StatusCallbackMethod": "POST",
        }]  # fmt: skip
        assert "https://demo.twilio.com/welcome/voice/" in out and "done: calls to" in out  # before, and after


async def test_twilio_setup_never_takes_over_another_systems_status_callback_unasked() -> None:
    """A number whose call statuses go to another system (a CRM): setup refuses and changes nothing, unless
    told to take them over; a callback already ours is no reason to stop (running setup twice is fine)."""
    async with serve_twilio_rest(ACCOUNT, ACCOUNT, SECRET) as twilio:
        # With basic auth in it, as such webhooks often are: printed without its password (review, session 29).
        twilio.add_number(NUMBER, status_callback="https://crm:s3cretpw@crm.example.com/status")
        env = {**_rest_env(twilio), "PUBLIC_URL": "https://voice.example.com"}
        rc, out, err = await _kame(["twilio", "setup", "--number", NUMBER, "--dry-run"], env)
        assert rc == 0 and "note: " in out and "--replace-status-callback" in out
        assert "https://crm:***@crm.example.com/status" in out and "s3cretpw" not in out + err
        rc, _, err = await _kame(["twilio", "setup", "--number", NUMBER], env)
        assert rc == 1 and "sends its call statuses to https://crm:***@crm.example.com/status" in err
        assert "s3cretpw" not in err
        assert "nothing changed" in err and not twilio.number_updates
        rc, _, err = await _kame(["twilio", "setup", "--number", NUMBER, "--replace-status-callback"], env)
        assert rc == 0, err
        rc, _, err = await _kame(["twilio", "setup", "--number", NUMBER], env)  # ours now: again is fine
        assert rc == 0, err
        moved = {**env, "PUBLIC_URL": "https://new-tunnel.example.com"}  # ours at an older URL: no question
        rc, _, err = await _kame(["twilio", "setup", "--number", NUMBER], moved)
        assert rc == 0, err
        ours = "https://voice.example.com" + CALL_STATUS_PATH
        assert [u["StatusCallback"] for u in twilio.number_updates] == [
            ours, ours, "https://new-tunnel.example.com" + CALL_STATUS_PATH]  # fmt: skip


async def test_twilio_setup_refuses_a_number_whose_calls_go_to_an_app_or_a_trunk() -> None:
    """A number attached to a TwiML App or an Elastic SIP Trunk ignores its voice URL: setup changed the URL
    and said "done", and calls still went to the app or the trunk (review, session 22)."""
    async with serve_twilio_rest(ACCOUNT, ACCOUNT, SECRET) as twilio:
        twilio.add_number(NUMBER, voice_application_sid="AP" + "1" * 32)
        other = "+15557654321"
        twilio.add_number(other, trunk_sid="TK" + "2" * 32)
        env = {**_rest_env(twilio), "PUBLIC_URL": "https://voice.example.com"}
        rc, _, err = await _kame(["twilio", "setup", "--number", NUMBER], env)
        assert rc == 1 and f"go to the TwiML App AP{'1' * 32}" in err and "nothing changed" in err
        rc, _, err = await _kame(["twilio", "setup", "--number", other, "--dry-run"], env)
        assert rc == 1 and f"go to the SIP trunk TK{'2' * 32}" in err
        assert not twilio.number_updates


async def test_twilio_setup_points_a_sip_domain_at_the_service() -> None:
    """A contact center's PBX trunks calls into a Twilio SIP Domain: setup points the domain's voice URL and
    its status callback at the service, as for a number."""
    async with serve_twilio_rest(ACCOUNT, ACCOUNT, SECRET) as twilio:
        twilio.add_sip_domain("other.sip.twilio.com")
        sid = twilio.add_sip_domain("acme.sip.twilio.com", voice_url="https://old.example.com/voice")
        env = {**_rest_env(twilio), "PUBLIC_URL": "https://voice.example.com"}
        rc, out, err = await _kame(["twilio", "setup", "--sip-domain", "ACME.sip.twilio.com"], env)
        assert rc == 0, err
        assert f"acme.sip.twilio.com ({sid}):" in out and "https://old.example.com/voice [POST]" in out
        assert twilio.sip_domain_updates == [{
            "VoiceUrl": "https://voice.example.com/twilio/voice", "VoiceMethod": "POST",
            "VoiceStatusCallbackUrl": "https://voice.example.com" + CALL_STATUS_PATH,
            "VoiceStatusCallbackMethod": "POST",
        }]  # fmt: skip
        assert twilio.sip_domains[sid]["voice_url"] == "https://voice.example.com/twilio/voice"
        assert not twilio.number_updates and 'numbers = ["sip:USER@acme.sip.twilio.com"]' in out
        rc, _, err = await _kame(["twilio", "setup", "--sip-domain", "nope.sip.twilio.com"], env)
        assert rc == 1 and "nope.sip.twilio.com is not a SIP Domain of account" in err
        rc, _, err = await _kame(["twilio", "setup", "--sip-domain", "acme.example.com"], env)
        assert rc == 2 and "--sip-domain must be a Twilio SIP Domain like acme.sip.twilio.com" in err
        rc, _, err = await _kame(["twilio", "setup", "--sip-domain", "acme.sip.twilio.com", "--number", NUMBER], env)
        assert rc == 2 and "not allowed with argument" in err
        assert len(twilio.sip_domain_updates) == 1


async def test_env_file_values_are_read_and_the_environment_overrides_them(tmp_path: Path) -> None:
    async with serve_twilio_rest(ACCOUNT, ACCOUNT, SECRET) as twilio:
        twilio.add_number(NUMBER)
        (tmp_path / ".env").write_text(textwrap.dedent(f"""
            # as copied from ops/.env.example
            TWILIO_ACCOUNT_SID={ACCOUNT}
            TWILIO_AUTH_TOKEN=an-old-token
            TWILIO_API_BASE_URL={twilio.base_url}
            PUBLIC_URL=https://from-dotenv.example.com
        """))
        # The .env token is refused; the environment's wins over it.
        default = {"KAME_ENV_FILE": ".env"}  # as outside the tests: .env in the working directory
        rc, _, err = await _kame(["twilio", "setup", "--number", NUMBER], default, cwd=tmp_path)
        assert rc == 1 and "refused the credentials" in err
        rc, _, err = await _kame(["twilio", "setup", "--number", NUMBER], {**default, "TWILIO_AUTH_TOKEN": SECRET},
                                 cwd=tmp_path)  # fmt: skip
        assert rc == 0, err
        assert twilio.number_updates[-1]["VoiceUrl"] == "https://from-dotenv.example.com/twilio/voice"
        # Stripped as serve strips it: a ConfigMap's newline (review, session 30).
        rc, _, err = await _kame(["twilio", "setup", "--number", NUMBER], {**default, "TWILIO_AUTH_TOKEN": SECRET,
                                 "PUBLIC_URL": "https://from-env.example.com\n"}, cwd=tmp_path)  # fmt: skip
        assert rc == 0 and twilio.number_updates[-1]["VoiceUrl"] == "https://from-env.example.com/twilio/voice", err
        # A file named and not there (a typo, a volume not mounted) is one line and exit 2, not a run without it.
        rc, _, err = await _kame(["twilio", "setup", "--number", NUMBER], {"KAME_ENV_FILE": "prod.env"}, cwd=tmp_path)
        assert rc == 2 and err.strip() == "kame-phone: KAME_ENV_FILE names prod.env, which is not a file (set it " \
            "empty to read none)", err
        # UTF-16 (PowerShell's `echo K=V > .env`): a traceback from every command, --help too (review, session 30).
        (tmp_path / ".env").write_text("PUBLIC_URL=https://from-dotenv.example.com\n", encoding="utf-16")
        rc, _, err = await _kame(["--help"], default, cwd=tmp_path)
        assert rc == 2 and err.strip() == "kame-phone: .env: cannot read it as UTF-8 KEY=VALUE lines " \
            "(UnicodeDecodeError)", err


@pytest.mark.parametrize(
    ("args", "env", "says", "code"),
    [
        (["twilio", "setup", "--number", "+15559990000"], {}, "+15559990000 is not a phone number of account", 1),
        (["twilio", "setup", "--number", NUMBER], {"TWILIO_AUTH_TOKEN": "wrong"}, "refused the credentials", 1),
        (["twilio", "setup", "--number", "555-1234"], {}, "--number must be an E.164 number", 2),
        (["twilio", "setup", "--number", ""], {}, "--number must be an E.164 number", 2),  # not the SIP path
        (["twilio", "setup", "--number", NUMBER], {"PUBLIC_URL": "http://voice.example.com"}, "must be https://", 2),
        # What `serve` refuses is never written to a live number (review, session 26): a query, a fragment, a
        # loopback address Twilio cannot reach (allowed only with a Twilio stand-in, as in these tests).
        (["twilio", "setup", "--number", NUMBER], {"PUBLIC_URL": "https://voice.example.com/?token=abc"},
         "PUBLIC_URL must look like https://host[:port][/path]", 2),
        (["twilio", "setup", "--number", NUMBER], {"PUBLIC_URL": "https://voice.example.com#x"},
         "PUBLIC_URL must look like https://host[:port][/path]", 2),
        (["twilio", "setup", "--number", NUMBER], {"PUBLIC_URL": "http://127.0.0.1:8080", "TWILIO_API_BASE_URL": ""},
         "is this machine's loopback: Twilio cannot reach it", 2),
        (["dial", "+15557654321", "--from", NUMBER], {"PUBLIC_URL": "https://voice.example.com/?a=1"},
         "PUBLIC_URL must look like", 2),
        (["twilio", "setup", "--number", NUMBER], {"TWILIO_ACCOUNT_SID": ""}, "no Twilio credentials", 2),
        # ops/.env.example copied and left as it is: said so, not a lookup of account "replace-with-..."
        (["twilio", "setup", "--number", NUMBER], {"TWILIO_ACCOUNT_SID": "replace-with-your-account-sid"},
         "TWILIO_ACCOUNT_SID still holds the placeholder from ops/.env.example", 2),
        (["dial", "+15557654321", "--from", "+15551112222"], {"TWILIO_AUTH_TOKEN": "wrong"},
         "refused the credentials", 1),
        (["dial", "12345", "--from", NUMBER], {}, "must be an E.164 number like +15551234567 or a sip: URI", 2),
        (["dial", "+15557654321", "--from", NUMBER, "--wait"], {}, "--wait reads the call's record", 2),
    ],
)  # fmt: skip
async def test_bad_numbers_and_refused_credentials_end_in_one_line(
    args: list[str], env: dict[str, str], says: str, code: int
) -> None:
    async with serve_twilio_rest(ACCOUNT, ACCOUNT, SECRET) as twilio:
        twilio.add_number(NUMBER)
        rc, out, err = await _kame(args, {**_rest_env(twilio), "PUBLIC_URL": "https://voice.example.com", **env})
    assert rc == code and says in err, err
    assert len(err.strip().splitlines()) == 1 and SECRET not in err and "wrong" not in err
    assert not twilio.number_updates and not twilio.created


async def test_dial_refuses_a_wait_it_cannot_keep_before_dialling() -> None:
    """`--wait-timeout nan` (or -5) placed a real, billed call, then gave up on it at once (review, session 29)."""
    async with serve_twilio_rest(ACCOUNT, ACCOUNT, SECRET) as twilio:
        twilio.add_number(NUMBER)
        for bad in ("nan", "-5"):
            rc, _, err = await _kame(["dial", "+15557654321", "--from", NUMBER, "--wait", "--wait-timeout", bad],
                                     {**_rest_env(twilio), "PUBLIC_URL": "https://voice.example.com"})  # fmt: skip
            assert rc == 2 and f"argument --wait-timeout: invalid number >= 1 value: '{bad}'" in err, err
        assert not twilio.created


async def test_dial_places_a_call_that_takes_the_inbound_path_and_reports_its_figures(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    agents_file = write_agents(tmp_path, f"""
        [agents.default]
        instructions = "You answer the phone for Acme Dental."
        [agents.sales]
        numbers = ["{NUMBER}"]
        instructions = "You sell Acme widgets."
        greeting = "Hi, this is Acme sales calling you back."
    """)
    directory = AgentDirectory.from_file(agents_file)
    wav = flite_wav("Hello, who is this?", tmp_path / "hello.wav")
    backend = BackendServices(BackendConfig(stt="none", llm_enabled=False), directory)  # says the greeting
    async with running_phone(tiny_checkpoint, agents=directory, backend=backend, admin_token="admin-secret") as phone, \
            serve_twilio_rest(ACCOUNT, ACCOUNT, SECRET) as twilio:  # fmt: skip
        twilio.answer_wav, twilio.media_ws_url, twilio.auth_token = wav, phone.ws_url, phone.token
        env = {**_rest_env(twilio), "PUBLIC_URL": phone.base, "ADMIN_TOKEN": "admin-secret",
               "KAME_AGENTS": str(agents_file)}  # fmt: skip
        # From one of our numbers: the agent claiming it speaks (the callee's number is nobody's).
        rc, out, err = await _kame(["dial", "+15557654321", "--from", NUMBER, "--wait", "--wait-timeout", "60"], env)
        assert rc == 0, err
        (created,) = twilio.created
        assert created["Url"] == phone.base + "/twilio/voice" and created["Method"] == "POST"
        assert created["To"] == "+15557654321" and created["From"] == NUMBER
        assert created["StatusCallback"] == phone.base + CALL_STATUS_PATH
        report = await twilio.reports[0]
        assert report.outcome == "completed" and report.bot_seconds_received > 1.0, report.errors
        call_sid, figures = out.strip().splitlines()
        record = await phone.store.get(call_sid)
        assert record is not None and record.state == "ended" and record.agent == "sales"
        assert record.oracle[0].text == "Hi, this is Acme sales calling you back."
        assert figures.startswith(f"call {call_sid}: completed, agent sales; first audio ")
        assert f"{record.first_audio_s:.2f} s" in figures
        # --agent names the agent on the webhook URL (Twilio signs it with the rest); a name the file lacks
        # is refused before anything is dialed.
        rc, out, err = await _kame(["dial", "+15557654321", "--from", "+15551112222", "--agent", "default"], env)
        assert rc == 0, err
        assert twilio.created[-1]["Url"] == phone.base + "/twilio/voice?agent=default"
        await twilio.reports[-1]
        rc, _, err = await _kame(["dial", "+15557654321", "--from", NUMBER, "--agent", "nobody"], env)
        assert rc == 2 and "--agent 'nobody' is not in" in err and len(twilio.created) == 2
        # An extension on the contact center's PBX, through its SIP trunk: Twilio dials the URI as given.
        rc, out, err = await _kame(["dial", "sip:1001@pbx.acme.example;transport=tls", "--from", NUMBER], env)
        assert rc == 0, err
        assert twilio.created[-1]["To"] == "sip:1001@pbx.acme.example;transport=tls"
        assert (await twilio.reports[-1]).outcome == "completed"
        # Nobody answers: the service never hears of the call, and --wait waited out its 15 minutes for a record.
        # Twilio's own status ends it.
        twilio.answer_wav = None
        rc, out, err = await _kame(["dial", "+15557654321", "--from", NUMBER, "--wait"], env)
        assert rc == 1 and f"call {out.strip()} was not answered: no-answer" in err, err
        twilio.unanswered_status = "completed"  # answered and over, but its webhook never reached the service
        rc, out, err = await _kame(["dial", "+15557654321", "--from", NUMBER, "--wait"], env)
        assert rc == 1 and "the service has no record of it" in err, err
        # Answered busy (the node draining): the figures, and a failing exit status for a smoke test.
        twilio.answer_wav, twilio.unanswered_status, phone.ctx.draining = wav, "no-answer", True
        rc, out, err = await _kame(["dial", "+15557654321", "--from", NUMBER, "--wait", "--wait-timeout", "60"], env)
        assert rc == 1 and ": busy, agent sales" in out and "ended busy" in err, (out, err)


async def test_the_call_status_callback_closes_a_call_that_never_streamed(tiny_checkpoint: Path) -> None:
    async with running_phone(tiny_checkpoint) as phone, aiohttp.ClientSession() as http:
        call_sid, _ = await phone.answer(http)  # answered, then the caller hangs up before the stream
        before = metric("kame_calls_total", outcome="no_stream")
        url = phone.base + CALL_STATUS_PATH
        params = {"CallSid": call_sid, "AccountSid": ACCOUNT, "CallStatus": "completed"}
        async with http.post(url, data=params) as r:  # unsigned: refused
            assert r.status == 403
        async with http.post(url, data=params, headers={"X-Twilio-Signature": phone.sign(url, params)}) as r:
            assert r.status == 204
        await phone.store.flush()
        record = await phone.store.get(call_sid)
    assert record is not None and (record.state, record.end_reason) == ("ended", "no_stream")
    assert metric("kame_calls_total", outcome="no_stream") == before + 1
    assert metric("kame_twilio_call_status_total", status="completed") >= 1


async def test_the_call_status_callback_leaves_a_call_that_did_stream_to_its_node(tiny_checkpoint: Path) -> None:
    """The call's stream started (its seat claimed) but its record still says ringing: the streaming node's
    writes wait out a Redis outage. Ended here as no_stream, the call was counted twice (no_stream here,
    completed there) and its record flipped once the other node's writes landed."""
    async with running_phone(tiny_checkpoint) as phone, aiohttp.ClientSession() as http:
        call_sid, params = await phone.answer(http)
        assert await phone.ctx.cluster.claim(call_sid, params["token"])  # the stream's start, as far as seats go
        before = metric("kame_calls_total", outcome="no_stream")
        url = phone.base + CALL_STATUS_PATH
        form = {"CallSid": call_sid, "AccountSid": ACCOUNT, "CallStatus": "completed"}
        async with http.post(url, data=form, headers={"X-Twilio-Signature": phone.sign(url, form)}) as r:
            assert r.status == 204
        await phone.store.flush()
        record = await phone.store.get(call_sid)
    assert record is not None and record.state == "ringing" and record.end_reason is None
    assert metric("kame_calls_total", outcome="no_stream") == before


def test_serve_says_once_which_webhook_url_twilio_must_use_and_whether_signatures_can_work() -> None:
    good = ServiceConfig(host="0.0.0.0", port=8080, twilio_auth_token="t", public_url="https://abc.trycloudflare.com")
    assert good.twilio_summary().startswith("Twilio voice webhook: POST https://abc.trycloudflare.com/twilio/voice")
    assert "consistent" in good.twilio_summary()
    local = ServiceConfig(host="127.0.0.1", port=8080, twilio_auth_token="t")
    assert "PUBLIC_URL is not set" in local.twilio_summary() and "tunnel" in local.twilio_summary()
    dev = ServiceConfig(host="127.0.0.1", port=8080, insecure_dev=True)
    assert "signatures NOT checked" in dev.twilio_summary()
