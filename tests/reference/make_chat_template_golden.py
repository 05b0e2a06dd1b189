#!/usr/bin/env python3
"""Writes tests/testdata/chat_template_golden.json: every chat template of
tests/testdata/chat_templates.json rendered on several conversations, and the
engine's feature templates below, by jinja2 in the environment Hugging Face
transformers' apply_chat_template uses (ImmutableSandboxedEnvironment with
trim_blocks, lstrip_blocks and loopcontrols; its tojson filter and
raise_exception global; tools=None and documents=None passed). The C++ test
(tests/model/tokenizer/chat_template_test.cc) compares model/tokenizer/chat_template.h's
renderings with these byte for byte, so it needs no Python.

  python3 tests/reference/make_chat_template_golden.py   (Debian's python3-jinja2)
"""
import json
import os
import sys

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))
TESTDATA = os.path.join(HERE, "..", "testdata")


class RaisedByTemplate(jinja2.exceptions.TemplateError):
    """What raise_exception(msg) raises (transformers raises TemplateError)."""


def raise_exception(message):
    raise RaisedByTemplate(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' override of jinja2's tojson (no HTML escaping).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def make_environment():
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


CONVERSATIONS = {
    "single_user": [("user", "Hello")],
    "system_user": [("system", "You are a helpful assistant"),
                    ("user", "Hello")],
    "multi_turn": [("system", "You are a helpful assistant"),
                   ("user", "Hello"), ("assistant", "Hi there"),
                   ("user", "Who are you"),
                   ("assistant", "   I am an assistant   "),
                   ("user", "Another question")],
    "no_system_multi_turn": [("user", "What is 2+2?"), ("assistant", "4."),
                             ("user", "And 3+3?")],
    "unicode_and_quotes": [
        ("system", "Réponds en français. «Guillemets» — 你好 🙂"),
        ("user", "He said \"hi\" and 'bye'\\n\twith a tab, a backslash \\ "
                 "and {{ not a tag }} {% neither %}"),
        ("assistant", "  Ça va?  \n"),
        ("user", "\u3000ideographic space\u3000 and\u00a0nbsp\r\n")],
    "ends_with_assistant": [("user", "Hi"), ("assistant", "Hello!")],
    "empty_content": [("user", "")],
    "roles_not_alternating": [("user", "first"), ("user", "second")],
    "system_only": [("system", "Only a system prompt")],
}

# Templates exercising each construct the engine supports; rendered on
# "multi_turn" with add_generation_prompt=True, bos_token "<s>", eos_token
# "</s>" and each one's extra variables.
FEATURES = [
    ("whitespace_control",
     "a  {%- if true %} b {% endif -%}  c\n  {% if true %}\n    x\n  {% endif %}\n"
     "{# comment #}\n  {#- c2 -#}  y {{- ' z ' -}} w\n"
     "{%+ if true %}kept-indent{% endif %}\n  {%+ if true +%}\nno-trim\n"
     "  {% endif %}\n\t{{ 'var-not-lstripped' }}\n"
     "{% for i in range(2) -%}\n  [{{ i }}]\n{%- endfor %}\nend\n\n"),
    ("crlf_and_tabs",
     "line1\r\n\t{% if true %}\r\nA\r\n\t {% endif %}\r\nend\r\n"),
    ("trailing_newlines", "x\n\n"),
    ("comment_trim", "a\n{# c #}\nb\n  {# indented #}\nc{#- x #} d"),
    ("arithmetic",
     "{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }}"
     " {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 2 ** -1 }} {{ 2 ** 3 ** 2 }}"
     " {{ 1.5 + 1 }} {{ 0.1 + 0.2 }} {{ 7.5 // 2 }} {{ -7.5 % 2 }} {{ 1_000 }}"
     " {{ 'a' ~ 1 ~ none ~ true }} {{ 'ab' * 3 }} {{ 2 * 'c' }} {{ [1] * 2 }}"
     " {{ [1, 2] + [3] }} {{ -(3) }} {{ +4 }} {{ 1 ~ 2 * 3 }} {{ -3|abs }}"
     " {{ true + 1 }}"),
    ("floats",
     "{{ 1/3 }} {{ 2/3 }} {{ 100.0 }} {{ 1e16 }} {{ 1e15 }} {{ 123456789.123 }}"
     " {{ -0.0 }} {{ 1e-4 }} {{ 0.00001234 }} {{ 1e20 }} {{ 3.0 }} {{ 2.5e-3 }}"
     " {{ 1E3 }} {{ 10 / 4 }}"),
    ("comparisons",
     "{{ 1 == 1.0 }} {{ 1 == true }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }}"
     " {{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 'b' in 'abc' }} {{ 'x' not in ['x'] }}"
     " {{ 'k' in {'k': 1} }} {{ none == none }} {{ nothing == nothing_else }}"
     " {{ 1 != 2 }} {{ 'é' > 'z' }} {{ {'a': 1} == {'a': 1.0} }} {{ [] == [] }}"
     " {{ 2 >= 2.0 }} {{ 'a' == 1 }}"),
    ("logic",
     "{{ 0 or 'x' }} {{ '' and 'y' }} {{ 'a' and 'b' }} {{ not none }}"
     " {{ none or [] }} {{ 'yes' if 1 > 0 else 'no' }} [{{ 'yes' if 0 }}]"
     " {{ not 1 == 2 }} {{ 'a' if false else 'b' if true else 'c' }}"
     " {{ not 'x' in 'xy' }} {{ nothing or 'fallback' }}"),
    ("string_literals",
     r"""{{ 'it\'s' }} {{ "say \"hi\"" }} {{ 'tab\there' }} {{ 'nl\nx' }} """
     r"""{{ '\u00e9\x41\101\\' }} {{ 'unknown \d escape' }} {{ 'é' }} """
     r"""{{ 'a' "b" 'c' }} {{ "multi
line" }} {{ '{{ not a tag }}' }}"""),
    ("printing_values",
     "{{ [1, 'a', none, true, 1.5, {'k': \"it's\"}, \"q\\\"\", 'a\\nb'] }}"
     " {{ {'a': [1, {'b': none}], 'c': ''} }} {{ [] }} {{ {} }} {{ true }}"
     " {{ none }} {{ [nothing] }} {{ ['é', 'tab\\t'] }}"),
    ("subscripts",
     "{{ messages[0]['role'] }} {{ messages[-1].content }} {{ messages.0.role }}"
     " {{ messages[1:3] | length }} {{ 'hello'[1:4] }} {{ 'hello'[::-1] }}"
     " {{ 'hello'[-3:] }} {{ [1,2,3,4,5][::2] }} {{ [1,2,3][5:] }}"
     " {{ 'héllo'[1] }} {{ [1,2,3][-1] }} {{ messages[99] is defined }}"
     " {{ messages[0].nope is defined }} {{ [1,2,3,4][-2:] }}"
     " {{ [1,2,3,4][3:0:-1] }} {{ 'abc'[10] is defined }} {{ messages[1:][0].role }}"),
    ("loop_variables",
     "{% for m in messages %}{{ loop.index }}/{{ loop.index0 }}/{{ loop.revindex }}"
     "/{{ loop.revindex0 }}/{{ loop.first }}/{{ loop.last }}/{{ loop.length }}"
     "/{{ loop.previtem.role if loop.previtem is defined else '-' }}"
     "/{{ loop.nextitem.role if not loop.last else '-' }}|{% endfor %}"),
    ("loop_forms",
     "{% for x in [] %}x{% else %}empty{% endfor %}"
     " {% for x in [1,2,3,4] if x is even %}{{ x }}:{{ loop.length }},{% endfor %}"
     " {% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}"
     " {% for x in range(10) %}{% if x == 7 %}{% break %}{% endif %}"
     "{% if x is odd %}{% continue %}{% endif %}{{ x }}{% endfor %}"
     " {% for a in [1,2] %}{% for b in 'xy' %}{{ a }}{{ b }}{{ loop.index }}"
     "{% endfor %}{{ loop.index }}{% endfor %}"
     " {% for k in {'p': 1, 'q': 2} %}{{ k }}{% endfor %}"
     " {% for (a, b) in [[1, 2], [3, 4]] %}{{ a + b }}{% endfor %}"
     " {% for k, v in {'z': 0}|items %}{{ k }}{{ v }}{% endfor %}"
     " {% for x in [1, 2] if false %}no{% else %}filtered-empty{% endfor %}"),
    ("scoping",
     "{% set x = 0 %}{% for i in range(3) %}{% set x = x + i %}{{ x }}{% endfor %}"
     "|{{ x }}|{% set ns = namespace(total=0, names=[]) %}"
     "{% for m in messages %}{% set ns.total = ns.total + 1 %}"
     "{% set ns.names = ns.names + [m.role] %}{% endfor %}"
     "{{ ns.total }} {{ ns.names|join(',') }} {% if true %}{% set y = 'set-in-if' %}"
     "{% endif %}{{ y }} {% set ns.extra = 'new' %}{{ ns.extra }}"
     " {% set messages = messages[:2] %}{{ messages|length }}"
     " {% for i in range(2) %}{% if i == 1 %}{{ z }}{% endif %}{% set z = 'zz' %}{% endfor %}"),
    ("set_forms",
     "{% set a, b = 1, 2 %}{{ a }}{{ b }} {% set captured %}  captured {{ a }}  "
     "{% endset %}[{{ captured }}] {% set t = [1, 2] %}{% set p, q = t %}{{ q }}"
     " {% set d = dict(k='v') %}{{ d.k }} {% set ns = namespace({'m': 1}, n=2) %}"
     "{{ ns.m + ns.n }}"),
    ("tests",
     "{{ x is defined }} {{ messages is defined }} {{ none is none }}"
     " {{ 'a' is string }} {{ 1 is number }} {{ 1.5 is number }} {{ true is number }}"
     " {{ {} is mapping }} {{ [] is iterable }} {{ 'a' is iterable }}"
     " {{ 1 is iterable }} {{ nothing is iterable }} {{ x is not defined }}"
     " {{ 3 is odd }} {{ 4 is even }} {{ 9 is divisibleby 3 }}"
     " {{ 9 is divisibleby(2) }} {{ 1 is integer }} {{ true is integer }}"
     " {{ true is boolean }} {{ 'abc' is lower }} {{ 'ABC' is upper }}"
     " {{ 2 is eq 2 }} {{ 2 is in [1, 2] }} {{ none is sameas none }}"
     " {{ nothing is sameas nothing }} {{ false is sameas 0 }}"
     " {{ raise_exception is callable }} {{ 1.0 is float }} {{ 'a' is sequence }}"
     " {{ true is true }} {{ 0 is false }} {{ 3 is gt 2 }} {{ 3 is le(2) }}"
     " {{ 1 is ne 2 }} {{ x is undefined }} {{ messages[0] is mapping }}"),
    ("string_filters",
     "{{ '  pad  '|trim }}|{{ 'xxhixx'|trim('x') }}|{{ 'héllo wörld'|upper }}"
     "|{{ 'ÀÉÎ ΣΑΣ ДОМ'|lower }}|{{ 'hello world-foo(bar [baz <q'|title }}"
     "|{{ \"they're bill's\".title() }}|{{ 'hELLO wORLD'|capitalize }}"
     "|{{ 'a-b-c'|replace('-', '+') }}|{{ 'aaa'|replace('a', 'b', 2) }}"
     "|{{ 'abc'|replace('', '.') }}|{{ 42|string }}|{{ none|string }}"
     "|{{ [1,'a',none]|join(', ') }}|{{ 'abc'|join('-') }}|{{ 'héllo'|length }}"
     "|{{ messages|length }}|{{ {'a':1}|count }}|{{ nothing|length }}"
     "|{{ 42|upper }}|{{ 'x y'|title }}|{{ '\u3000 wide \u00a0'|trim }}"
     "|{{ ['a', 'b']|join }}|{{ messages[0].role|upper }}"),
    ("other_filters",
     "{{ nothing|default('dflt') }}|{{ ''|default('empty', true) }}"
     "|{{ none|default('n') }}|{{ 0|d('zero', boolean=true) }}|{{ [3,4]|first }}"
     "|{{ [3,4]|last }}|{{ 'xyz'|first }}|{{ 'xyz'|last }}"
     "|{{ {'k': 1, 'j': 2}|first }}|{{ []|first is defined }}|{{ '42'|int + 1 }}"
     "|{{ '4.7'|int }}|{{ 'x'|int }}|{{ 'x'|int(7) }}|{{ 3.9|int }}|{{ -3.9|int }}"
     "|{{ ' 12 '|int }}|{{ '1_000'|int }}|{{ 'ff'|int(base=16) }}|{{ true|int }}"
     "|{{ '2.5'|float * 2 }}|{{ 'x'|float }}|{{ 'ab'|list }}|{{ range(3)|list }}"
     "|{{ range(1, 10, 3)|list }}|{{ range(5, 0, -2)|list }}|{{ nothing|default }}"
     "|{{ messages|first|length }}|{{ (messages|last).content }}"),
    ("tojson",
     "{{ {'b': [1, 2.5, none, true, false], 'a': 'é\"<>&\\'\\n\\t', 'c': {}}|tojson }}"
     "|{{ {'b': 1, 'a': [1, {'x': []}]}|tojson(indent=2) }}"
     "|{{ {'b': 1, 'a': 2}|tojson(sort_keys=true) }}|{{ 'é'|tojson(ensure_ascii=true) }}"
     "|{{ [1, 2]|tojson(separators=(',', ':')) }}|{{ messages[0]|tojson }}"
     "|{{ '🙂\\x01'|tojson(ensure_ascii=true) }}|{{ 1e100|tojson }}|{{ 3.0|tojson }}"
     "|{{ [1, [2]]|tojson(indent='--') }}|{{ none|tojson }}|{{ 'x'|tojson(indent=4) }}"),
    ("list_filters",
     "{{ messages|selectattr('role', 'equalto', 'user')|map(attribute='content')"
     "|join(',') }}|{{ messages|rejectattr('role', 'in', ['user', 'system'])|list"
     "|length }}|{{ [0, 1, 2, '', 'x']|select|list }}|{{ [1, 2, 3, 4]|reject('odd')"
     "|list }}|{{ [1, 2, 3]|select('gt', 1)|list }}"
     "|{{ messages|selectattr('missing', 'undefined')|list|length }}"
     "|{{ ['a', 'B', 'c']|map('upper')|list }}"
     "|{{ messages|map(attribute='nope', default='-')|join }}"
     "|{{ [[1, 2], [3]]|map('length')|list }}"
     "|{% for k, v in {'b': 1, 'A': 2, 'c': 0}|dictsort %}{{ k }}{{ v }}{% endfor %}"
     "|{% for k, v in {'b': 1, 'A': 2}|dictsort(true) %}{{ k }}{% endfor %}"
     "|{% for k, v in {'b': 1, 'a': 2}|dictsort(by='value', reverse=true) %}"
     "{{ k }}{% endfor %}|{{ ['b', 'A', 'c']|sort }}"
     "|{{ ['b', 'A', 'c']|sort(case_sensitive=true) }}|{{ [3, 1, 2]|sort(reverse=true) }}"
     "|{{ messages|sort(attribute='role')|map(attribute='content')|join('/') }}"
     "|{{ [[1, 'x'], [0, 'y']]|map(attribute='1')|join }}"
     "|{{ messages|selectattr('role')|list|length }}"
     "|{{ messages|map('tojson')|first }}"),
    ("tuples_and_numbers",
     "{{ (1, 'a') }} {{ (1,) }} {{ () }} {{ 1, 2 }} {{ (1, 2) == [1, 2] }}"
     " {{ (1, 2) == (1, 2) }} {{ (1, 2) + (3,) }} {{ (1, 2)[1:] }} {{ (0,) * 2 }}"
     " {{ {'a': 1}.items()|list }} {{ ('x', 'y')|join }} {{ 0x1F }} {{ 0b101 }}"
     " {{ 0o17 }} {{ 0 }} {{ 0_0 }} {{ 1_000_000 }} {{ 0.5 }} {{ 00.5 }}"
     " {{ messages|join('|', attribute='role') }} {{ [[1, 2], [3, 4]]|join(',', 1) }}"
     " {{ ('a', 'b') is iterable }} {{ 'ab'.startswith(('x', 'a')) }}"),
    ("comment_at_end", "text{#"),
    ("comment_at_end_strip", "text  \n {#-"),
    ("methods",
     "{{ '  x  '.strip() }}|{{ 'xxhixx'.strip('x') }}|{{ '  x  '.lstrip() }}"
     "|{{ '  x  '.rstrip() }}|{{ 'a b  c '.split() }}|{{ 'a,b,,c'.split(',') }}"
     "|{{ 'a b c'.split(' ', 1) }}|{{ '  a  b  '.split(none, 1) }}"
     "|{{ 'hello'.startswith('he') }}|{{ 'hello'.endswith(('x', 'lo')) }}"
     "|{{ 'Hi'.upper() }}|{{ 'Hi'.lower() }}|{{ 'a-b'.replace('-', '') }}"
     "|{{ ', '.join(['a', 'b']) }}|{% set d = {'k': 'v', 'n': none} %}"
     "{{ d.keys()|list }}|{{ d.values()|list }}|{{ d.get('k') }}"
     "|{{ d.get('missing', 'fallback') }}|{{ d.get('missing') }}|{{ d.k }}"
     "|{{ d['n'] }}|{% for k, v in d.items() %}{{ k }}{{ v }}{% endfor %}"
     "|{{ 'ab cd'.title() }}|{{ 'hELLO'.capitalize() }}|{{ messages[0].content.split()|length }}"),
    ("undefined",
     "[{{ nothing }}][{{ nothing|trim }}][{{ nothing ~ 'x' }}]"
     "[{% for x in nothing %}never{% endfor %}][{{ nothing is none }}]"
     "[{{ not nothing }}][{% if nothing %}t{% else %}f{% endif %}]"
     "[{{ messages[0].missing }}][{{ nothing|default('d') }}][{{ 'x' in nothing }}]"
     "[{{ nothing|upper }}][{{ nothing|join(',') }}][{{ none.attr }}][{{ 5.attr is defined }}]"),
    ("globals",
     "{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ tools is none }}"
     "|{{ documents }}|{{ extra_var }}|{{ tools is defined }}",
     {"extra_var": "EXTRA \"quoted\""}),
    ("raise_with_computed_message",
     "{% if messages|length > 2 %}{{ raise_exception('too long: ' ~ messages|length"
     " ~ ' messages') }}{% endif %}"),
    ("raise_in_loop",
     "{% for m in messages %}{% if m.role == 'assistant' %}"
     "{{ raise_exception('no assistant turns, found one at ' ~ loop.index0) }}"
     "{% endif %}{{ m.role }}{% endfor %}"),
    # Runtime errors: only that both engines fail is compared.
    ("error_str_plus_int", "{{ 'a' + 1 }}"),
    ("error_undefined_attribute", "{{ nothing.attr }}"),
    ("error_undefined_arithmetic", "{{ nothing + 1 }}"),
    ("error_undefined_item", "{{ none.x.y }}"),
    ("error_order_mixed", "{{ 1 < 'a' }}"),
    ("error_zero_step", "{{ [1, 2][::0] }}"),
    ("error_division_by_zero", "{{ 1 // 0 }}"),
    ("error_iterate_int", "{% for x in 5 %}{% endfor %}"),
    ("error_undefined_function", "{{ strftime_now('%Y') }}"),
    ("error_range_too_big", "{{ range(200000)|length }}"),
    ("error_unknown_method", "{{ 'x'.nosuch() }}"),
    ("error_unknown_filter_in_branch",
     "{% if messages %}{{ messages|nosuchfilter }}{% endif %}"),
    ("error_not_callable", "{{ bos_token() }}"),
    ("error_unpack", "{% for a, b in [[1, 2, 3]] %}{% endfor %}"),
    ("error_sort_mixed", "{{ [1, 'a']|sort }}"),
    ("error_select_unknown_test", "{{ [1]|select('frobnicated')|list }}"),
    ("error_leading_zero", "{{ 05 }}"),
    ("error_unclosed_comment", "{# x"),
    ("error_test_extra_argument", "{{ 1 is odd 3 }}"),
    ("error_undefined_int", "{{ nothing|int }}"),
    ("error_undefined_float", "{{ nothing|float }}"),
    ("error_unhashable_in", "{{ [1] in {'a': 1} }}"),
    ("error_set_attribute_on_dict", "{% set d = {} %}{% set d.x = 1 %}"),
]


def render(env, template, messages, add_generation_prompt, variables):
    try:
        output = env.from_string(template).render(
            messages=[{"role": r, "content": c} for r, c in messages],
            add_generation_prompt=add_generation_prompt,
            tools=None, documents=None, **variables)
        return {"output": output}
    except RaisedByTemplate as e:
        return {"error": str(e), "raised": True}
    except Exception as e:  # noqa: BLE001 - any other jinja2/Python error
        return {"error": f"{type(e).__name__}: {e}", "raised": False}


def main():
    env = make_environment()
    with open(os.path.join(TESTDATA, "chat_templates.json"), encoding="utf-8") as f:
        templates = json.load(f)["templates"]
    renders = []
    for t in templates:
        variables = {"bos_token": t["bos_token"], "eos_token": t["eos_token"]}
        for conversation, messages in CONVERSATIONS.items():
            for add_generation_prompt in (False, True):
                result = render(env, t["template"], messages,
                                add_generation_prompt, variables)
                renders.append({"template": t["name"],
                                "conversation": conversation,
                                "add_generation_prompt": add_generation_prompt,
                                **result})
    features = []
    for entry in FEATURES:
        name, template = entry[0], entry[1]
        variables = {"bos_token": "<s>", "eos_token": "</s>",
                     **(entry[2] if len(entry) > 2 else {})}
        result = render(env, template, CONVERSATIONS["multi_turn"], True,
                        variables)
        if name.startswith("error_") != ("error" in result and
                                         not result["raised"]):
            sys.exit(f"feature {name}: unexpected result {result}")
        features.append({"name": name, "template": template,
                         "variables": variables, **result})
    golden = {
        "comment": "Written by tests/reference/make_chat_template_golden.py "
                   "with jinja2 " + jinja2.__version__ + "; do not edit.",
        "conversations": {name: [{"role": r, "content": c} for r, c in m]
                          for name, m in CONVERSATIONS.items()},
        "renders": renders,
        "features": features,
    }
    with open(os.path.join(TESTDATA, "chat_template_golden.json"), "w",
              encoding="utf-8") as f:
        json.dump(golden, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
