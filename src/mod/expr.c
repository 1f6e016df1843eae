/* mod/expr.c -- mask_mod / score_mod expressions (spec 13): a recursive-descent parser that
 * builds a typed tree (every node knows whether it is an int, a float or a bool, so that a type
 * error is found once, with its position, and never at evaluation), then a post-order program
 * for a small stack machine: the CPU evaluates it per (b, h, q_idx, kv_idx) without allocating.
 *
 * Grammar (C precedence, lowest first; Python's `//`, `%` floor semantics):
 *   ternary := or ['?' ternary ':' ternary]
 *   or      := and {'||' and}            and := bitor {'&&' bitor}
 *   bitor   := bitxor {'|' bitxor}       bitxor := bitand {'^' bitand}
 *   bitand  := cmp {'&' cmp}             cmp := add [('<'|'<='|'>'|'>='|'=='|'!=') add]
 *   add     := mul {('+'|'-') mul}       mul := unary {('*'|'/'|'//'|'%') unary}
 *   unary   := ('-'|'+'|'!'|'~') unary | primary
 *   primary := number | 'true' | 'false' | name | name '(' args ')' | name '[' args ']' | '(' ternary ')'
 */
#include "expr.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../dtype.h"

typedef enum vtype { T_BOOL, T_INT, T_FLOAT } vtype;
static const char *const TYPE_NAME[] = {"bool", "int", "float"};

/* Tree nodes and program instructions share one opcode list. */
typedef enum opcode {
    O_INT, O_FLOAT, O_VAR_B, O_VAR_H, O_VAR_Q, O_VAR_K, O_VAR_SCORE, O_READ, O_TO_FLOAT,
    O_ADD, O_SUB, O_MUL, O_DIV, O_FLOORDIV, O_MOD, O_NEG,
    O_LT, O_LE, O_GT, O_GE, O_EQ, O_NE,
    O_AND, O_OR, O_NOT, O_BAND, O_BOR, O_BXOR, O_BNOT,
    O_WHERE, O_MIN, O_MAX, O_ABS, O_EXP, O_LOG, O_TANH, O_SIGMOID, O_SQRT, O_FLOOR
} opcode;

enum { MAX_NODES = 4096, MAX_ARGS = 4, MAX_DEPTH = 64, MAX_TEXT = 65536 };

typedef struct node {
    opcode op;
    vtype type;
    int kid[MAX_ARGS], nkid;
    int64_t i;   /* O_INT */
    float f;     /* O_FLOAT */
    int cap;     /* O_READ */
    int pos;     /* 1-based column of the token that made it */
} node;

/* One instruction: an opcode working on the type it was checked for. */
typedef struct insn {
    unsigned char op, type, nargs, cap;
    int16_t arg[MAX_ARGS]; /* the instructions that computed the operands (reverse mode) */
    int16_t node;          /* the tree node it computes (printing the program as C) */
    union {
        int64_t i;
        float f;
    } imm;
} insn;

struct nsa_mod {
    expr_kind kind;
    int n;
    unsigned uses;
    expr_capture cap[EXPR_MAX_CAPTURES];
    char names[EXPR_MAX_CAPTURES][EXPR_MAX_NAME];
    int ncap;
    node *tree;   /* kept for printing */
    int root;
    insn code[];  /* n instructions */
};

typedef struct parser {
    const char *s;
    size_t at;
    const char *what;
    expr_kind kind;
    const expr_capture *caps;
    int ncap;
    node *nodes;
    int nnodes;
    int depth;
    nsa_status err; /* first error (its detail written) */
} parser;

/* ---- errors ------------------------------------------------------------------------------ */
#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static int fail_at(parser *p, int pos, const char *fmt, ...)
{
    if (p->err != NSA_STATUS_SUCCESS) return -1;
    char msg[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    p->err = nsa_fail(NSA_STATUS_BAD_EXPRESSION, "%s:%d: %s", p->what, pos, msg);
    return -1;
}

/* ---- lexer ------------------------------------------------------------------------------- */
static void skip_space(parser *p)
{
    while (p->s[p->at] == ' ' || p->s[p->at] == '\t' || p->s[p->at] == '\n' || p->s[p->at] == '\r') p->at++;
}

static int col(const parser *p) { return (int)p->at + 1; }

/* Consumes `tok` when the text continues with it (and, for a one-char operator, not with a
 * longer operator that starts with it). */
static int accept(parser *p, const char *tok)
{
    skip_space(p);
    const size_t n = strlen(tok);
    if (strncmp(p->s + p->at, tok, n) != 0) return 0;
    const char next = p->s[p->at + n];
    if (n == 1) {
        const char c = tok[0];
        if ((c == '<' || c == '>' || c == '!' || c == '=') && next == '=') return 0;
        if ((c == '&' && next == '&') || (c == '|' && next == '|') || (c == '/' && next == '/')) return 0;
    }
    p->at += n;
    return 1;
}

static int is_alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
static int is_digit(char c) { return c >= '0' && c <= '9'; }

/* ---- tree building with types ------------------------------------------------------------ */
static int add_node(parser *p, opcode op, vtype type, int pos, const int *kids, int nkid)
{
    if (p->err != NSA_STATUS_SUCCESS) return -1;
    if (p->nnodes >= MAX_NODES) return fail_at(p, pos, "the expression is too long (more than %d nodes)", MAX_NODES);
    node *n = &p->nodes[p->nnodes];
    memset(n, 0, sizeof *n);
    n->op = op, n->type = type, n->pos = pos, n->nkid = nkid;
    for (int i = 0; i < nkid; i++) n->kid[i] = kids[i];
    return p->nnodes++;
}

static int to_float(parser *p, int k)
{
    if (k < 0) return -1;
    if (p->nodes[k].type == T_FLOAT) return k;
    if (p->nodes[k].op == O_INT) { /* fold a literal */
        p->nodes[k].op = O_FLOAT, p->nodes[k].type = T_FLOAT, p->nodes[k].f = (float)p->nodes[k].i;
        return k;
    }
    return add_node(p, O_TO_FLOAT, T_FLOAT, p->nodes[k].pos, &k, 1);
}

/* Numeric operands (bool counts as int): both int -> int, else both float. */
static int numeric(parser *p, int *a, int *b, const char *op, int pos)
{
    if (p->err != NSA_STATUS_SUCCESS) return -1;
    if (p->nodes[*a].type == T_FLOAT || p->nodes[*b].type == T_FLOAT) {
        *a = to_float(p, *a), *b = to_float(p, *b);
        return T_FLOAT;
    }
    (void)op, (void)pos;
    return T_INT;
}

static int binary(parser *p, opcode op, int a, int b, int pos, const char *tok)
{
    if (a < 0 || b < 0) return -1;
    const vtype ta = p->nodes[a].type, tb = p->nodes[b].type;
    vtype t;
    switch (op) {
    case O_ADD: case O_SUB: case O_MUL: case O_FLOORDIV: case O_MOD: case O_MIN: case O_MAX:
        t = (vtype)numeric(p, &a, &b, tok, pos);
        break;
    case O_DIV: /* true division, as Python's / */
        a = to_float(p, a), b = to_float(p, b), t = T_FLOAT;
        break;
    case O_LT: case O_LE: case O_GT: case O_GE: case O_EQ: case O_NE:
        if ((op == O_EQ || op == O_NE) && ta == T_BOOL && tb == T_BOOL) {
            t = T_BOOL;
            break;
        }
        numeric(p, &a, &b, tok, pos);
        t = T_BOOL;
        break;
    case O_AND: case O_OR:
        if (ta != T_BOOL || tb != T_BOOL)
            return fail_at(p, pos, "'%s' needs two bools, got %s and %s", tok, TYPE_NAME[ta], TYPE_NAME[tb]);
        t = T_BOOL;
        break;
    case O_BAND: case O_BOR: case O_BXOR: /* bools: logical; ints: bitwise (Python's &, |, ^) */
        if (ta == T_BOOL && tb == T_BOOL) {
            t = T_BOOL;
        } else if (ta != T_FLOAT && tb != T_FLOAT && ta == tb) {
            t = T_INT;
        } else {
            return fail_at(p, pos, "'%s' needs two bools or two ints, got %s and %s", tok, TYPE_NAME[ta], TYPE_NAME[tb]);
        }
        break;
    default:
        return fail_at(p, pos, "internal: binary operator %d", (int)op);
    }
    if (p->err != NSA_STATUS_SUCCESS) return -1;
    const int kids[2] = {a, b};
    return add_node(p, op, t, pos, kids, 2);
}

static int parse_ternary(parser *p);

/* `where(c, a, b)` and `c ? a : b`: c a bool, a and b of one type (int and float: float). */
static int select3(parser *p, int c, int a, int b, int pos)
{
    if (c < 0 || a < 0 || b < 0) return -1;
    if (p->nodes[c].type != T_BOOL) return fail_at(p, pos, "the condition must be a bool, got %s", TYPE_NAME[p->nodes[c].type]);
    vtype t = p->nodes[a].type;
    if (p->nodes[a].type != p->nodes[b].type) {
        if (p->nodes[a].type == T_BOOL || p->nodes[b].type == T_BOOL)
            return fail_at(p, pos, "the two values must both be bools or both numbers, got %s and %s",
                           TYPE_NAME[p->nodes[a].type], TYPE_NAME[p->nodes[b].type]);
        t = (vtype)numeric(p, &a, &b, "where", pos);
    }
    const int kids[3] = {c, a, b};
    return add_node(p, O_WHERE, t, pos, kids, 3);
}

static const struct {
    const char *name;
    opcode op;
    int nargs;
} FUNCS[] = {
    {"where", O_WHERE, 3}, {"min", O_MIN, 2},         {"max", O_MAX, 2},   {"abs", O_ABS, 1},
    {"exp", O_EXP, 1},     {"log", O_LOG, 1},         {"tanh", O_TANH, 1}, {"sigmoid", O_SIGMOID, 1},
    {"sqrt", O_SQRT, 1},   {"floor", O_FLOOR, 1},
};

static int parse_args(parser *p, int *args, int max, char close)
{
    int n = 0;
    char closing[2] = {close, 0};
    if (accept(p, closing)) return 0;
    for (;;) {
        if (n == max) {
            fail_at(p, col(p), "too many arguments (at most %d)", max);
            return n;
        }
        args[n++] = parse_ternary(p);
        if (p->err != NSA_STATUS_SUCCESS) return n;
        if (accept(p, closing)) return n;
        if (!accept(p, ",")) {
            fail_at(p, col(p), "expected ',' or '%c'", close);
            return n;
        }
    }
}

static int call_func(parser *p, const char *name, int pos)
{
    int args[MAX_ARGS];
    const int n = parse_args(p, args, MAX_ARGS, ')');
    if (p->err != NSA_STATUS_SUCCESS) return -1;
    for (size_t f = 0; f < sizeof FUNCS / sizeof FUNCS[0]; f++) {
        if (strcmp(FUNCS[f].name, name) != 0) continue;
        if (n != FUNCS[f].nargs) return fail_at(p, pos, "%s takes %d argument%s, got %d", name, FUNCS[f].nargs, FUNCS[f].nargs > 1 ? "s" : "", n);
        const opcode op = FUNCS[f].op;
        if (op == O_WHERE) return select3(p, args[0], args[1], args[2], pos);
        if (op == O_MIN || op == O_MAX) {
            if (p->nodes[args[0]].type == T_BOOL || p->nodes[args[1]].type == T_BOOL)
                return fail_at(p, pos, "%s needs numbers, got a bool", name);
            return binary(p, op, args[0], args[1], pos, name);
        }
        const vtype t = p->nodes[args[0]].type;
        if (t == T_BOOL) return fail_at(p, pos, "%s needs a number, got a bool", name);
        if (op == O_ABS) return add_node(p, O_ABS, t, pos, args, 1);
        int x = to_float(p, args[0]);
        return add_node(p, op, T_FLOAT, pos, &x, 1);
    }
    return fail_at(p, pos, "unknown function '%s' (known: where, min, max, abs, exp, log, tanh, sigmoid, sqrt, floor)", name);
}

static int read_capture(parser *p, int cap, int pos)
{
    int args[MAX_ARGS];
    const nsa_tensor *t = &p->caps[cap].tensor;
    const int n = parse_args(p, args, MAX_ARGS, ']');
    if (p->err != NSA_STATUS_SUCCESS) return -1;
    if (n != t->rank)
        return fail_at(p, pos, "'%s' has rank %d, indexed with %d index%s", p->caps[cap].name, (int)t->rank, n, n == 1 ? "" : "es");
    for (int i = 0; i < n; i++)
        if (p->nodes[args[i]].type != T_INT)
            return fail_at(p, p->nodes[args[i]].pos, "index %d of '%s' must be an int, got %s", i, p->caps[cap].name,
                           TYPE_NAME[p->nodes[args[i]].type]);
    const vtype type = t->dtype == NSA_DTYPE_I32 ? T_INT : t->dtype == NSA_DTYPE_U8 ? T_BOOL : T_FLOAT;
    const int k = add_node(p, O_READ, type, pos, args, n);
    if (k >= 0) p->nodes[k].cap = cap;
    return k;
}

static int parse_primary(parser *p)
{
    skip_space(p);
    const int pos = col(p);
    const char *s = p->s + p->at;
    if (is_digit(*s) || (*s == '.' && is_digit(s[1]))) {
        char *end = NULL;
        size_t len = 0;
        int is_float = 0;
        while (is_digit(s[len])) len++;
        if (s[len] == '.' || s[len] == 'e' || s[len] == 'E') is_float = 1;
        if (is_float) {
            const double v = strtod(s, &end);
            if (is_alpha(*end) || is_digit(*end) || *end == '.') return fail_at(p, pos, "malformed number");
            p->at += (size_t)(end - s);
            const int k = add_node(p, O_FLOAT, T_FLOAT, pos, NULL, 0);
            if (k >= 0) p->nodes[k].f = (float)v;
            return k;
        }
        int64_t v = 0;
        for (size_t i = 0; i < len; i++) {
            if (v > (INT64_MAX - (s[i] - '0')) / 10) return fail_at(p, pos, "integer literal does not fit int64");
            v = v * 10 + (s[i] - '0');
        }
        if (is_alpha(s[len])) return fail_at(p, pos, "malformed number");
        p->at += len;
        const int k = add_node(p, O_INT, T_INT, pos, NULL, 0);
        if (k >= 0) p->nodes[k].i = v;
        return k;
    }
    if (is_alpha(*s)) {
        char name[EXPR_MAX_NAME + 1];
        size_t len = 0;
        while (is_alpha(s[len]) || is_digit(s[len])) len++;
        if (len > EXPR_MAX_NAME) return fail_at(p, pos, "name longer than %d characters", EXPR_MAX_NAME);
        memcpy(name, s, len);
        name[len] = 0;
        p->at += len;
        if (accept(p, "(")) return call_func(p, name, pos);
        if (accept(p, "[")) {
            for (int c = 0; c < p->ncap; c++)
                if (strcmp(p->caps[c].name, name) == 0) return read_capture(p, c, pos);
            return fail_at(p, pos, "unknown tensor '%s' (indexing needs a captured tensor)", name);
        }
        static const struct {
            const char *name;
            opcode op;
            vtype t;
        } VARS[] = {{"b", O_VAR_B, T_INT}, {"h", O_VAR_H, T_INT}, {"q_idx", O_VAR_Q, T_INT}, {"kv_idx", O_VAR_K, T_INT},
                    {"score", O_VAR_SCORE, T_FLOAT}};
        for (size_t v = 0; v < sizeof VARS / sizeof VARS[0]; v++) {
            if (strcmp(VARS[v].name, name) != 0) continue;
            if (VARS[v].op == O_VAR_SCORE && p->kind == EXPR_MASK) return fail_at(p, pos, "'score' is not known in a mask_mod");
            return add_node(p, VARS[v].op, VARS[v].t, pos, NULL, 0);
        }
        if (!strcmp(name, "true") || !strcmp(name, "false") || !strcmp(name, "True") || !strcmp(name, "False")) {
            const int k = add_node(p, O_INT, T_BOOL, pos, NULL, 0);
            if (k >= 0) p->nodes[k].i = name[0] == 't' || name[0] == 'T';
            return k;
        }
        for (int c = 0; c < p->ncap; c++)
            if (strcmp(p->caps[c].name, name) == 0)
                return fail_at(p, pos, "'%s' is a tensor: read an element, e.g. %s[...]", name, name);
        return fail_at(p, pos, "unknown name '%s' (variables: b, h, q_idx, kv_idx%s)", name, p->kind == EXPR_SCORE ? ", score" : "");
    }
    if (accept(p, "(")) {
        const int k = parse_ternary(p);
        if (p->err == NSA_STATUS_SUCCESS && !accept(p, ")")) return fail_at(p, col(p), "expected ')'");
        return k;
    }
    if (!*s) return fail_at(p, pos, "unexpected end of the expression");
    return fail_at(p, pos, "unexpected '%c'", *s);
}

static int parse_unary(parser *p)
{
    skip_space(p);
    const int pos = col(p);
    if (++p->depth > MAX_DEPTH) return fail_at(p, pos, "the expression nests deeper than %d", MAX_DEPTH);
    int k;
    if (accept(p, "-")) {
        k = parse_unary(p);
        if (k >= 0 && p->nodes[k].type == T_BOOL) k = fail_at(p, pos, "'-' needs a number, got a bool");
        else if (k >= 0 && p->nodes[k].op == O_INT) p->nodes[k].i = -p->nodes[k].i, p->nodes[k].pos = pos;
        else if (k >= 0 && p->nodes[k].op == O_FLOAT) p->nodes[k].f = -p->nodes[k].f, p->nodes[k].pos = pos;
        else if (k >= 0) k = add_node(p, O_NEG, p->nodes[k].type, pos, &k, 1);
    } else if (accept(p, "+")) {
        k = parse_unary(p);
        if (k >= 0 && p->nodes[k].type == T_BOOL) k = fail_at(p, pos, "'+' needs a number, got a bool");
    } else if (accept(p, "!")) {
        k = parse_unary(p);
        if (k >= 0 && p->nodes[k].type != T_BOOL) k = fail_at(p, pos, "'!' needs a bool, got %s", TYPE_NAME[p->nodes[k].type]);
        else if (k >= 0) k = add_node(p, O_NOT, T_BOOL, pos, &k, 1);
    } else if (accept(p, "~")) { /* Python's ~: not of a bool, bitwise not of an int */
        k = parse_unary(p);
        if (k >= 0 && p->nodes[k].type == T_FLOAT) k = fail_at(p, pos, "'~' needs a bool or an int, got float");
        else if (k >= 0) k = add_node(p, p->nodes[k].type == T_BOOL ? O_NOT : O_BNOT, p->nodes[k].type, pos, &k, 1);
    } else {
        k = parse_primary(p);
    }
    p->depth--;
    return k;
}

static int parse_mul(parser *p)
{
    int a = parse_unary(p);
    for (;;) {
        skip_space(p);
        const int pos = col(p);
        opcode op;
        const char *tok;
        if (accept(p, "//")) op = O_FLOORDIV, tok = "//";
        else if (accept(p, "*")) op = O_MUL, tok = "*";
        else if (accept(p, "/")) op = O_DIV, tok = "/";
        else if (accept(p, "%")) op = O_MOD, tok = "%";
        else return a;
        const int b = parse_unary(p);
        if (a >= 0 && b >= 0 && (p->nodes[a].type == T_BOOL || p->nodes[b].type == T_BOOL))
            return fail_at(p, pos, "'%s' needs numbers, got a bool", tok);
        a = binary(p, op, a, b, pos, tok);
    }
}

static int parse_add(parser *p)
{
    int a = parse_mul(p);
    for (;;) {
        skip_space(p);
        const int pos = col(p);
        opcode op;
        if (accept(p, "+")) op = O_ADD;
        else if (accept(p, "-")) op = O_SUB;
        else return a;
        const int b = parse_mul(p);
        if (a >= 0 && b >= 0 && (p->nodes[a].type == T_BOOL || p->nodes[b].type == T_BOOL))
            return fail_at(p, pos, "'%c' needs numbers, got a bool", op == O_ADD ? '+' : '-');
        a = binary(p, op, a, b, pos, op == O_ADD ? "+" : "-");
    }
}

static int parse_cmp(parser *p)
{
    int a = parse_add(p);
    skip_space(p);
    const int pos = col(p);
    static const struct {
        const char *tok;
        opcode op;
    } CMP[] = {{"<=", O_LE}, {">=", O_GE}, {"==", O_EQ}, {"!=", O_NE}, {"<", O_LT}, {">", O_GT}};
    for (size_t i = 0; i < sizeof CMP / sizeof CMP[0]; i++) {
        if (!accept(p, CMP[i].tok)) continue;
        const int b = parse_add(p);
        if (a >= 0 && b >= 0 && CMP[i].op != O_EQ && CMP[i].op != O_NE &&
            (p->nodes[a].type == T_BOOL || p->nodes[b].type == T_BOOL))
            return fail_at(p, pos, "'%s' needs numbers, got a bool", CMP[i].tok);
        if (a >= 0 && b >= 0 && (p->nodes[a].type == T_BOOL) != (p->nodes[b].type == T_BOOL))
            return fail_at(p, pos, "'%s' compares a bool with a number", CMP[i].tok);
        a = binary(p, CMP[i].op, a, b, pos, CMP[i].tok);
        skip_space(p);
        for (size_t j = 0; j < sizeof CMP / sizeof CMP[0]; j++)
            if (!strncmp(p->s + p->at, CMP[j].tok, strlen(CMP[j].tok)))
                return fail_at(p, col(p), "chained comparison: write (a %s b) && (b %s c)", CMP[i].tok, CMP[j].tok);
        return a;
    }
    return a;
}

/* One left-associative level of binary operators. */
static int parse_level(parser *p, int (*next)(parser *), const char *tok, opcode op)
{
    int a = next(p);
    for (;;) {
        skip_space(p);
        const int pos = col(p);
        if (!accept(p, tok)) return a;
        a = binary(p, op, a, next(p), pos, tok);
    }
}

static int parse_bitand(parser *p) { return parse_level(p, parse_cmp, "&", O_BAND); }
static int parse_bitxor(parser *p) { return parse_level(p, parse_bitand, "^", O_BXOR); }
static int parse_bitor(parser *p) { return parse_level(p, parse_bitxor, "|", O_BOR); }
static int parse_and(parser *p) { return parse_level(p, parse_bitor, "&&", O_AND); }
static int parse_or(parser *p) { return parse_level(p, parse_and, "||", O_OR); }

static int parse_ternary(parser *p)
{
    if (++p->depth > MAX_DEPTH) return fail_at(p, col(p), "the expression nests deeper than %d", MAX_DEPTH);
    int c = parse_or(p);
    skip_space(p);
    const int pos = col(p);
    if (accept(p, "?")) {
        const int a = parse_ternary(p);
        if (p->err == NSA_STATUS_SUCCESS && !accept(p, ":")) c = fail_at(p, col(p), "expected ':' of '?'");
        else c = select3(p, c, a, parse_ternary(p), pos);
    }
    p->depth--;
    return c;
}

/* ---- captures ------------------------------------------------------------------------------ */
static nsa_status check_captures(parser *p)
{
    for (int c = 0; c < p->ncap; c++) {
        const expr_capture *x = &p->caps[c];
        const char *n = x->name;
        if (!n) return nsa_fail(NSA_STATUS_NULL_POINTER, "%s: capture %d: name is NULL", p->what, c);
        size_t len = strlen(n);
        int ok = len >= 1 && len <= EXPR_MAX_NAME && is_alpha(n[0]);
        for (size_t i = 1; ok && i < len; i++) ok = is_alpha(n[i]) || is_digit(n[i]);
        static const char *const RESERVED[] = {"b", "h", "q_idx", "kv_idx", "score", "true", "false", "True", "False"};
        for (size_t r = 0; ok && r < sizeof RESERVED / sizeof RESERVED[0]; r++) ok = strcmp(n, RESERVED[r]) != 0;
        for (size_t f = 0; ok && f < sizeof FUNCS / sizeof FUNCS[0]; f++) ok = strcmp(n, FUNCS[f].name) != 0;
        if (!ok)
            return nsa_fail(NSA_STATUS_BAD_EXPRESSION, "%s: capture %d: '%.40s' is not a free name (letters, digits, _, at "
                            "most %d; not a variable or function)", p->what, c, n, EXPR_MAX_NAME);
        for (int d = 0; d < c; d++)
            if (!strcmp(p->caps[d].name, n)) return nsa_fail(NSA_STATUS_BAD_EXPRESSION, "%s: capture '%s' given twice", p->what, n);
        const nsa_tensor *t = &x->tensor;
        if (t->rank < 1 || t->rank > NSA_MAX_RANK)
            return nsa_fail(NSA_STATUS_BAD_RANK, "%s: capture '%s': rank %d, must be 1..%d", p->what, n, (int)t->rank, NSA_MAX_RANK);
        if (t->dtype != NSA_DTYPE_I32 && t->dtype != NSA_DTYPE_U8 && t->dtype != NSA_DTYPE_F32 && t->dtype != NSA_DTYPE_F16 &&
            t->dtype != NSA_DTYPE_BF16)
            return nsa_fail(NSA_STATUS_BAD_DTYPE, "%s: capture '%s': dtype %d is not one of i32, u8, f32, f16, bf16", p->what, n,
                            (int)t->dtype);
        int64_t count = 1;
        for (int d = 0; d < t->rank; d++) {
            if (t->shape[d] < 1)
                return nsa_fail(NSA_STATUS_BAD_SHAPE, "%s: capture '%s': dim %d is %" PRId64 ", must be >= 1 (a read "
                                "needs an element)", p->what, n, d, t->shape[d]);
            if (t->stride[d] < 0)
                return nsa_fail(NSA_STATUS_BAD_STRIDE, "%s: capture '%s': stride[%d] is negative", p->what, n, d);
            if (count > INT64_MAX / t->shape[d])
                return nsa_fail(NSA_STATUS_SIZE_OVERFLOW, "%s: capture '%s': element count overflows int64", p->what, n);
            count *= t->shape[d];
        }
        if (!t->data) return nsa_fail(NSA_STATUS_NULL_POINTER, "%s: capture '%s': data is NULL", p->what, n);
    }
    return NSA_STATUS_SUCCESS;
}

/* ---- the program ----------------------------------------------------------------------------- */
/* Post-order emission; returns the stack depth the subtree needs. */
static int emit(expr_program *prog, const node *nodes, int k)
{
    const node *n = &nodes[k];
    int need = 0, kid_pc[MAX_ARGS] = {0};
    for (int i = 0; i < n->nkid; i++) {
        const int d = emit(prog, nodes, n->kid[i]) + i;
        need = d > need ? d : need;
        kid_pc[i] = prog->n - 1;
    }
    insn *in = &prog->code[prog->n++];
    memset(in, 0, sizeof *in);
    for (int i = 0; i < n->nkid; i++) in->arg[i] = (int16_t)kid_pc[i];
    in->node = (int16_t)k;
    in->op = (unsigned char)n->op;
    /* the operand type for comparisons and arithmetic: that of the (unified) kids */
    in->type = (unsigned char)(n->nkid > 0 && n->op != O_WHERE && n->op != O_READ ? nodes[n->kid[0]].type : n->type);
    if (n->op == O_WHERE) in->type = (unsigned char)n->type;
    in->nargs = (unsigned char)n->nkid;
    in->cap = (unsigned char)n->cap;
    if (n->op == O_INT) in->imm.i = n->i;
    if (n->op == O_FLOAT) in->imm.f = n->f;
    if (n->op == O_VAR_B) prog->uses |= 1;
    if (n->op == O_VAR_H) prog->uses |= 2;
    if (n->op == O_VAR_Q) prog->uses |= 4;
    if (n->op == O_VAR_K) prog->uses |= 8;
    if (n->op == O_VAR_SCORE) prog->uses |= 16;
    return need > 1 ? need : 1;
}

nsa_status expr_compile(const char *text, expr_kind kind, const expr_capture *captures, int num_captures, const char *what,
                        expr_program **out)
{
    if (!out) return nsa_fail(NSA_STATUS_NULL_POINTER, "%s: out is NULL", what ? what : "expression");
    *out = NULL;
    what = what ? what : kind == EXPR_MASK ? "mask_mod" : "score_mod";
    if (!text) return nsa_fail(NSA_STATUS_NULL_POINTER, "%s: the expression text is NULL", what);
    if (kind != EXPR_MASK && kind != EXPR_SCORE) return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "%s: kind %d unknown", what, (int)kind);
    if (num_captures < 0 || num_captures > EXPR_MAX_CAPTURES || (num_captures > 0 && !captures))
        return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "%s: %d captures (at most %d, and a list when > 0)", what, num_captures,
                        EXPR_MAX_CAPTURES);
    size_t len = 0; /* (C11 has no strnlen) */
    while (len <= MAX_TEXT && text[len]) len++;
    if (len > MAX_TEXT)
        return nsa_fail(NSA_STATUS_BAD_EXPRESSION, "%s: longer than %d characters", what, MAX_TEXT);
    parser p = {text, 0, what, kind, captures, num_captures, NULL, 0, 0, NSA_STATUS_SUCCESS};
    nsa_status st = check_captures(&p);
    if (st != NSA_STATUS_SUCCESS) return st;
    p.nodes = (node *)malloc(MAX_NODES * sizeof(node));
    if (!p.nodes) return nsa_fail(NSA_STATUS_OUT_OF_MEMORY, "%s: no memory for the parser", what);
    int root = parse_ternary(&p);
    skip_space(&p);
    if (p.err == NSA_STATUS_SUCCESS && p.s[p.at]) fail_at(&p, col(&p), "unexpected '%c' after the expression", p.s[p.at]);
    if (p.err == NSA_STATUS_SUCCESS) {
        const vtype t = p.nodes[root].type;
        if (kind == EXPR_MASK && t != T_BOOL)
            fail_at(&p, 1, "a mask_mod must give a bool, this gives %s (compare it: ... != 0)", TYPE_NAME[t]);
        if (kind == EXPR_SCORE && t == T_BOOL) fail_at(&p, 1, "a score_mod must give a number, this gives a bool");
        if (kind == EXPR_SCORE && t == T_INT) root = to_float(&p, root);
    }
    if (p.err != NSA_STATUS_SUCCESS) {
        free(p.nodes);
        return p.err;
    }
    expr_program *prog = (expr_program *)calloc(1, sizeof *prog + (size_t)p.nnodes * sizeof(insn));
    if (!prog) {
        free(p.nodes);
        return nsa_fail(NSA_STATUS_OUT_OF_MEMORY, "%s: no memory for the program", what);
    }
    prog->kind = kind;
    prog->ncap = num_captures;
    for (int c = 0; c < num_captures; c++) {
        prog->cap[c] = captures[c];
        snprintf(prog->names[c], sizeof prog->names[c], "%s", captures[c].name);
        prog->cap[c].name = prog->names[c]; /* (the caller's string need not outlive the call) */
    }
    if (emit(prog, p.nodes, root) > MAX_DEPTH + MAX_ARGS) { /* (the parser's depth limit keeps it far below) */
        free(p.nodes), free(prog);
        return nsa_fail(NSA_STATUS_BAD_EXPRESSION, "%s: the expression needs too deep a stack", what);
    }
    prog->tree = p.nodes;
    prog->root = root;
    *out = prog;
    return NSA_STATUS_SUCCESS;
}

void expr_free(expr_program *p)
{
    if (!p) return;
    free(p->tree);
    free(p);
}

unsigned expr_uses(const expr_program *p) { return p ? p->uses : 0; }
int expr_size(const expr_program *p) { return p ? p->n : 0; }
expr_kind expr_kind_of(const expr_program *p) { return p->kind; }
int expr_num_captures(const expr_program *p) { return p->ncap; }
const nsa_tensor *expr_capture_tensor(const expr_program *p, int c) { return &p->cap[c].tensor; }
const char *expr_capture_name(const expr_program *p, int c) { return p->names[c]; }

/* ---- the public face: nsa_mod ---------------------------------------------------------------- */
nsa_status nsa_mod_create(nsa_mod **mod, nsa_mod_kind kind, const char *text, const nsa_mod_tensor *tensors,
                          int32_t num_tensors)
{
    nsa_detail_clear();
    if (!mod) return nsa_fail(NSA_STATUS_NULL_POINTER, "mod is NULL");
    *mod = NULL;
    if (kind != NSA_MOD_MASK && kind != NSA_MOD_SCORE)
        return nsa_fail(NSA_STATUS_BAD_ARGUMENT, "kind: %d, must be NSA_MOD_MASK (0) or NSA_MOD_SCORE (1)", (int)kind);
    const nsa_status st = expr_compile(text, kind == NSA_MOD_MASK ? EXPR_MASK : EXPR_SCORE, tensors, num_tensors, NULL, mod);
    if (st == NSA_STATUS_SUCCESS) nsa_detail_clear();
    return st;
}

void nsa_mod_destroy(nsa_mod *mod) { expr_free(mod); }

/* ---- evaluation ------------------------------------------------------------------------------ */
typedef union value {
    int64_t i;
    float f;
} value;

static int64_t floordiv_i(int64_t a, int64_t b)
{
    if (b == 0) return 0; /* defined, documented: x // 0 = 0 */
    if (b == -1) return a == INT64_MIN ? INT64_MIN : -a; /* (wraps as two's complement would) */
    int64_t q = a / b;
    if ((a % b != 0) && ((a < 0) != (b < 0))) q--;
    return q;
}

static int64_t mod_i(int64_t a, int64_t b)
{
    if (b == 0 || b == -1) return 0; /* x % 0 = 0 */
    int64_t r = a % b;
    if (r != 0 && ((r < 0) != (b < 0))) r += b;
    return r;
}

/* Wrapping int64 arithmetic (no undefined behaviour on overflow). */
static int64_t wrap_add(int64_t a, int64_t b) { return (int64_t)((uint64_t)a + (uint64_t)b); }
static int64_t wrap_sub(int64_t a, int64_t b) { return (int64_t)((uint64_t)a - (uint64_t)b); }
static int64_t wrap_mul(int64_t a, int64_t b) { return (int64_t)((uint64_t)a * (uint64_t)b); }

static float read_capture_value(const expr_capture *c, const value *idx, int n)
{
    const nsa_tensor *t = &c->tensor;
    int64_t off = 0;
    for (int d = 0; d < n; d++) {
        int64_t i = idx[d].i;
        i = i < 0 ? 0 : i >= t->shape[d] ? t->shape[d] - 1 : i; /* clamped: never out of bounds */
        off += i * t->stride[d];
    }
    switch (t->dtype) {
    case NSA_DTYPE_F32: return ((const float *)t->data)[off];
    case NSA_DTYPE_F16: return nsa_f16_to_f32(((const uint16_t *)t->data)[off]);
    case NSA_DTYPE_BF16: return nsa_bf16_to_f32(((const uint16_t *)t->data)[off]);
    default: return 0.0f;
    }
}

static int64_t read_capture_int(const expr_capture *c, const value *idx, int n)
{
    const nsa_tensor *t = &c->tensor;
    int64_t off = 0;
    for (int d = 0; d < n; d++) {
        int64_t i = idx[d].i;
        i = i < 0 ? 0 : i >= t->shape[d] ? t->shape[d] - 1 : i;
        off += i * t->stride[d];
    }
    return t->dtype == NSA_DTYPE_I32 ? ((const int32_t *)t->data)[off] : ((const uint8_t *)t->data)[off] != 0;
}

static float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

/* The pair an expression is evaluated at. */
typedef struct expr_at {
    int64_t b, h, q, k;
    float score;
} expr_at;

/* One instruction's result from its operands (opd[0] the first), the evaluator's arithmetic,
 * shared by expr_eval and expr_grad. */
static value expr_apply(const expr_program *p, const insn *in, const value *opd, const expr_at *at)
{
    const int fl = in->type == T_FLOAT;
    const value *x = &opd[in->nargs > 0 ? in->nargs - 1 : 0], *y = &opd[0]; /* (x: the last operand, y: the first) */
    value r;
    r.i = 0;
    switch ((opcode)in->op) {
    case O_INT: r.i = in->imm.i; break;
    case O_FLOAT: r.f = in->imm.f; break;
    case O_VAR_B: r.i = at->b; break;
    case O_VAR_H: r.i = at->h; break;
    case O_VAR_Q: r.i = at->q; break;
    case O_VAR_K: r.i = at->k; break;
    case O_VAR_SCORE: r.f = at->score; break;
    case O_READ: {
        const expr_capture *c = &p->cap[in->cap];
        if (c->tensor.dtype == NSA_DTYPE_F32 || c->tensor.dtype == NSA_DTYPE_F16 || c->tensor.dtype == NSA_DTYPE_BF16)
            r.f = read_capture_value(c, opd, in->nargs);
        else
            r.i = read_capture_int(c, opd, in->nargs);
        break;
    }
    case O_TO_FLOAT: r.f = (float)x->i; break;
    case O_NEG: if (fl) r.f = -x->f; else r.i = wrap_sub(0, x->i); break;
    case O_ABS: if (fl) r.f = fabsf(x->f); else r.i = x->i < 0 ? wrap_sub(0, x->i) : x->i; break;
    case O_NOT: r.i = !x->i; break;
    case O_BNOT: r.i = ~x->i; break;
    case O_EXP: r.f = expf(x->f); break;
    case O_LOG: r.f = logf(x->f); break;
    case O_TANH: r.f = tanhf(x->f); break;
    case O_SIGMOID: r.f = sigmoid_f(x->f); break;
    case O_SQRT: r.f = sqrtf(x->f); break;
    case O_FLOOR: r.f = floorf(x->f); break;
    case O_WHERE: r = opd[0].i ? opd[1] : opd[2]; break;
    case O_ADD: if (fl) r.f = y->f + x->f; else r.i = wrap_add(y->i, x->i); break;
    case O_SUB: if (fl) r.f = y->f - x->f; else r.i = wrap_sub(y->i, x->i); break;
    case O_MUL: if (fl) r.f = y->f * x->f; else r.i = wrap_mul(y->i, x->i); break;
    case O_DIV: r.f = y->f / x->f; break;
    case O_FLOORDIV: if (fl) r.f = floorf(y->f / x->f); else r.i = floordiv_i(y->i, x->i); break;
    case O_MOD:
        if (fl) r.f = y->f - floorf(y->f / x->f) * x->f; /* Python's float %: the sign of the divisor */
        else r.i = mod_i(y->i, x->i);
        break;
    case O_MIN: if (fl) r.f = y->f < x->f || y->f != y->f ? y->f : x->f; else r.i = y->i < x->i ? y->i : x->i; break;
    case O_MAX: if (fl) r.f = y->f > x->f || y->f != y->f ? y->f : x->f; else r.i = y->i > x->i ? y->i : x->i; break;
    case O_LT: r.i = fl ? y->f < x->f : y->i < x->i; break;
    case O_LE: r.i = fl ? y->f <= x->f : y->i <= x->i; break;
    case O_GT: r.i = fl ? y->f > x->f : y->i > x->i; break;
    case O_GE: r.i = fl ? y->f >= x->f : y->i >= x->i; break;
    case O_EQ: r.i = fl ? y->f == x->f : y->i == x->i; break;
    case O_NE: r.i = fl ? y->f != x->f : y->i != x->i; break;
    case O_AND: case O_BAND: r.i = y->i & x->i; break;
    case O_OR: case O_BOR: r.i = y->i | x->i; break;
    case O_BXOR: r.i = y->i ^ x->i; break;
    }
    return r;
}

float expr_eval(const expr_program *p, int64_t b, int64_t h, int64_t q_idx, int64_t kv_idx, float score)
{
    const expr_at at = {b, h, q_idx, kv_idx, score};
    value st[MAX_DEPTH + 2 * MAX_ARGS + 8];
    int sp = 0;
    for (int pc = 0; pc < p->n; pc++) {
        const insn *in = &p->code[pc];
        sp -= in->nargs; /* the operands are the top nargs values, the first lowest */
        st[sp] = expr_apply(p, in, &st[sp], &at);
        sp++;
    }
    return p->kind == EXPR_MASK ? (st[0].i ? 1.0f : 0.0f) : st[0].f;
}

/* ---- C / CUDA source ------------------------------------------------------------------------- */
/* Plain C that NVRTC compiles too: no headers (the includer provides expf, logf, tanhf, sqrtf,
 * floorf, fabsf), long long for int64, unions for bit casts, wrapping integer arithmetic and
 * Python's floor division as the evaluator computes them. */
const char EXPR_C_PRELUDE[] =
    "typedef struct nsa_mod_caps {\n"
    "    const void *data[16];\n"
    "    long long shape[16][4];\n"
    "    long long stride[16][4];\n"
    "    int dtype[16];\n"
    "} nsa_mod_caps;\n"
    "NSA_MOD_FN long long nsa_mod_add(long long a, long long b) { return (long long)((unsigned long long)a + (unsigned long long)b); }\n"
    "NSA_MOD_FN long long nsa_mod_sub(long long a, long long b) { return (long long)((unsigned long long)a - (unsigned long long)b); }\n"
    "NSA_MOD_FN long long nsa_mod_mul(long long a, long long b) { return (long long)((unsigned long long)a * (unsigned long long)b); }\n"
    "NSA_MOD_FN long long nsa_mod_floordiv(long long a, long long b)\n"
    "{\n"
    "    if (b == 0) return 0;\n"
    "    if (b == -1) return nsa_mod_sub(0, a);\n"
    "    long long q = a / b;\n"
    "    if (a % b != 0 && ((a < 0) != (b < 0))) q--;\n"
    "    return q;\n"
    "}\n"
    "NSA_MOD_FN long long nsa_mod_mod(long long a, long long b)\n"
    "{\n"
    "    if (b == 0 || b == -1) return 0;\n"
    "    long long r = a % b;\n"
    "    if (r != 0 && ((r < 0) != (b < 0))) r += b;\n"
    "    return r;\n"
    "}\n"
    "NSA_MOD_FN float nsa_mod_fmod(float a, float b) { return a - floorf(a / b) * b; }\n"
    "NSA_MOD_FN long long nsa_mod_imin(long long a, long long b) { return a < b ? a : b; }\n"
    "NSA_MOD_FN long long nsa_mod_imax(long long a, long long b) { return a > b ? a : b; }\n"
    "NSA_MOD_FN long long nsa_mod_iabs(long long a) { return a < 0 ? nsa_mod_sub(0, a) : a; }\n"
    "NSA_MOD_FN int nsa_mod_iabs32(int a) { return a < 0 ? -a : a; }\n"
    "NSA_MOD_FN int nsa_mod_imin32(int a, int b) { return a < b ? a : b; }\n"
    "NSA_MOD_FN int nsa_mod_imax32(int a, int b) { return a > b ? a : b; }\n"
    "NSA_MOD_FN int nsa_mod_floordiv32(int a, int b)\n"
    "{\n"
    "    if (b == 0) return 0;\n"
    "    if (b == -1) return -a;\n"
    "    int q = a / b;\n"
    "    if (a % b != 0 && ((a < 0) != (b < 0))) q--;\n"
    "    return q;\n"
    "}\n"
    "NSA_MOD_FN int nsa_mod_mod32(int a, int b)\n"
    "{\n"
    "    if (b == 0 || b == -1) return 0;\n"
    "    int r = a % b;\n"
    "    if (r != 0 && ((r < 0) != (b < 0))) r += b;\n"
    "    return r;\n"
    "}\n"
    "NSA_MOD_FN float nsa_mod_fmin(float a, float b) { return a < b || a != a ? a : b; }\n"
    "NSA_MOD_FN float nsa_mod_fmax(float a, float b) { return a > b || a != a ? a : b; }\n"
    "NSA_MOD_FN float nsa_mod_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }\n"
    "NSA_MOD_FN float nsa_mod_fbits(unsigned int u) { union { unsigned int u; float f; } x; x.u = u; return x.f; }\n"
    "NSA_MOD_FN float nsa_mod_f16(unsigned short h)\n"
    "{\n"
    "    const unsigned int s = (unsigned int)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;\n"
    "    if (e == 0x1f) return nsa_mod_fbits(s | 0x7f800000u | (m << 13));\n"
    "    if (e) return nsa_mod_fbits(s | ((e + 112u) << 23) | (m << 13));\n"
    "    const float v = (float)m * 5.9604644775390625e-8f;\n"
    "    return s ? -v : v;\n"
    "}\n"
    "NSA_MOD_FN long long nsa_mod_off(const nsa_mod_caps *c, int k, int n, long long i0, long long i1, long long i2,\n"
    "                                 long long i3)\n"
    "{\n"
    "    const long long ix[4] = {i0, i1, i2, i3};\n"
    "    long long off = 0;\n"
    "    for (int d = 0; d < n; d++) {\n"
    "        const long long i = ix[d] < 0 ? 0 : ix[d] >= c->shape[k][d] ? c->shape[k][d] - 1 : ix[d];\n"
    "        off += i * c->stride[k][d];\n"
    "    }\n"
    "    return off;\n"
    "}\n"
    "NSA_MOD_FN long long nsa_mod_lin(const nsa_mod_caps *c, int k, int n, long long i0, long long i1, long long i2,\n"
    "                                 long long i3)\n"
    "{\n"
    "    const long long ix[4] = {i0, i1, i2, i3};\n"
    "    long long lin = 0;\n"
    "    for (int d = 0; d < n; d++) {\n"
    "        const long long i = ix[d] < 0 ? 0 : ix[d] >= c->shape[k][d] ? c->shape[k][d] - 1 : ix[d];\n"
    "        lin = lin * c->shape[k][d] + i;\n"
    "    }\n"
    "    return lin;\n"
    "}\n"
    "NSA_MOD_FN float nsa_mod_readf(const nsa_mod_caps *c, int k, int n, int dt, long long i0, long long i1, long long i2,\n"
    "                               long long i3)\n"
    "{\n"
    "    const long long o = nsa_mod_off(c, k, n, i0, i1, i2, i3);\n"
    "    if (dt == 0) return ((const float *)c->data[k])[o];\n"
    "    if (dt == 1) return nsa_mod_f16(((const unsigned short *)c->data[k])[o]);\n"
    "    return nsa_mod_fbits((unsigned int)((const unsigned short *)c->data[k])[o] << 16);\n"
    "}\n"
    "NSA_MOD_FN long long nsa_mod_readi(const nsa_mod_caps *c, int k, int n, int dt, long long i0, long long i1, long long i2,\n"
    "                                   long long i3)\n"
    "{\n"
    "    const long long o = nsa_mod_off(c, k, n, i0, i1, i2, i3);\n"
    "    if (dt == 3) return ((const int *)c->data[k])[o];\n"
    "    return ((const unsigned char *)c->data[k])[o] != 0;\n"
    "}\n";

void expr_caps(const expr_program *p, nsa_mod_caps *caps)
{
    memset(caps, 0, sizeof *caps);
    for (int c = 0; c < p->ncap; c++) {
        const nsa_tensor *t = &p->cap[c].tensor;
        caps->data[c] = t->data;
        caps->dtype[c] = (int32_t)t->dtype;
        for (int d = 0; d < t->rank; d++) caps->shape[c][d] = t->shape[d], caps->stride[c][d] = t->stride[d];
    }
}

typedef struct writer {
    char *buf;
    size_t size, len;
    const int *pc_of; /* NULL: a kid is printed as its subtree; else as v<its instruction> (the program as statements) */
    const unsigned char *narrow; /* per tree node, 1: an int computed in 32 bits (expr_to_c's idx32); NULL: none */
} writer;

/* ---- 32-bit integers where they are exact ----------------------------------------------------
 * The language's integers are 64-bit. Where every value an int node (and each int operand of it)
 * can take fits in 32 bits, the generated code may compute it in 32-bit arithmetic with the same
 * result: q_idx - kv_idx, abs of it, a document id compared, the index of a bias table -- the
 * per-score work of most mods, and on a GPU half the instructions (64-bit adds, compares and
 * int64 -> float conversions are several each). The ranges are intervals from the operands' ranges,
 * with b, h, q_idx, kv_idx in [0, 2^31) (the caller's guarantee) and i32 reads in int32; anything
 * that could leave int64 is "unknown". */
typedef struct irange {
    int64_t lo, hi;
    int known;
} irange;

static irange ir_make(int64_t lo, int64_t hi) { irange r = {lo, hi, 1}; return r; }
static const irange IR_UNKNOWN = {0, 0, 0};

/* the interval of a op b for + - * from the four corner values (exact in __int128-free form:
 * each corner checked for int64 overflow) */
static irange ir_arith(opcode op, irange a, irange b)
{
    if (!a.known || !b.known) return IR_UNKNOWN;
    const int64_t xs[2] = {a.lo, a.hi}, ys[2] = {b.lo, b.hi};
    int64_t lo = 0, hi = 0;
    for (int i = 0; i < 4; i++) {
        const int64_t x = xs[i >> 1], y = ys[i & 1];
        int64_t v;
        const int over = op == O_ADD ? __builtin_add_overflow(x, y, &v) : op == O_SUB ? __builtin_sub_overflow(x, y, &v)
                                                                                      : __builtin_mul_overflow(x, y, &v);
        if (over) return IR_UNKNOWN;
        if (i == 0 || v < lo) lo = v;
        if (i == 0 || v > hi) hi = v;
    }
    return ir_make(lo, hi);
}

static int ir_fits32(irange r) { return r.known && r.lo >= INT32_MIN && r.hi <= INT32_MAX; }

/* The range of tree node k (ints and bools), memoised in r[] / done[]. */
static irange ir_of(const expr_program *p, int k, irange *r, unsigned char *done)
{
    if (done[k]) return r[k];
    const node *n = &p->tree[k];
    irange a = IR_UNKNOWN, b = IR_UNKNOWN, out = IR_UNKNOWN;
    for (int i = 0; i < n->nkid; i++) { /* every kid (an int below a float node too); a and b: the int operands' */
        const irange x = ir_of(p, n->kid[i], r, done);
        if (i < 2 && p->tree[n->kid[i]].type != T_FLOAT) *(i ? &b : &a) = x;
    }
    if (n->type == T_BOOL) out = ir_make(0, 1);
    else if (n->type == T_INT) switch (n->op) {
        case O_INT: out = ir_make(n->i, n->i); break;
        case O_VAR_B: case O_VAR_H: case O_VAR_Q: case O_VAR_K: out = ir_make(0, INT32_MAX); break; /* (idx32) */
        case O_READ: out = ir_make(INT32_MIN, INT32_MAX); break; /* an i32 capture */
        case O_ADD: case O_SUB: case O_MUL: out = ir_arith((opcode)n->op, a, b); break;
        case O_NEG: out = ir_arith(O_SUB, ir_make(0, 0), a); break;
        case O_ABS:
            if (a.known && a.lo > INT64_MIN) {
                const int64_t m = -a.lo > a.hi ? -a.lo : a.hi;
                out = a.lo >= 0 ? a : a.hi <= 0 ? ir_make(-a.hi, -a.lo) : ir_make(0, m);
            }
            break;
        case O_MIN: if (a.known && b.known) out = ir_make(a.lo < b.lo ? a.lo : b.lo, a.hi < b.hi ? a.hi : b.hi); break;
        case O_MAX: if (a.known && b.known) out = ir_make(a.lo > b.lo ? a.lo : b.lo, a.hi > b.hi ? a.hi : b.hi); break;
        case O_FLOORDIV: /* |a // b| <= |a| (b = 0 gives 0, b = -1 gives -a) */
            if (a.known && a.lo > INT64_MIN) {
                const int64_t m = -a.lo > a.hi ? -a.lo : a.hi;
                out = ir_make(-m, m);
            }
            break;
        case O_MOD: /* Python's a % b: |r| < |b|, 0 for b in {0, -1} */
            if (b.known && b.lo > INT64_MIN) {
                const int64_t m = -b.lo > b.hi ? -b.lo : b.hi;
                out = ir_make(m > 0 ? -(m - 1) : 0, m > 0 ? m - 1 : 0);
            }
            break;
        case O_WHERE: {
            const irange c = r[n->kid[2]];
            if (b.known && c.known) out = ir_make(b.lo < c.lo ? b.lo : c.lo, b.hi > c.hi ? b.hi : c.hi);
            break;
        }
        case O_BAND: case O_BOR: case O_BXOR: /* sign-extended 32-bit operands give a sign-extended result */
            if (ir_fits32(a) && ir_fits32(b)) out = ir_make(INT32_MIN, INT32_MAX);
            break;
        case O_BNOT: if (ir_fits32(a)) out = ir_make(INT32_MIN, INT32_MAX); break;
        default: break;
        }
    r[k] = out, done[k] = 1;
    return out;
}

/* narrow[k] = 1 for the int nodes computed in 32 bits: the node's range fits and so does every
 * int operand's (a read's indices excepted: they are passed as 64-bit indices either way). */
static void ir_mark(const expr_program *p, int k, const irange *r, unsigned char *narrow)
{
    const node *n = &p->tree[k];
    int ok = n->type == T_INT && ir_fits32(r[k]);
    for (int i = 0; i < n->nkid; i++) {
        ir_mark(p, n->kid[i], r, narrow);
        if (n->op != O_READ && p->tree[n->kid[i]].type == T_INT && !narrow[n->kid[i]]) ok = 0;
    }
    narrow[k] = (unsigned char)ok;
}

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
static void put(writer *w, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    const size_t room = w->len < w->size ? w->size - w->len : 0;
    const int n = vsnprintf(room ? w->buf + w->len : NULL, room, fmt, ap);
    va_end(ap);
    if (n > 0) w->len += (size_t)n;
}

static void print_node(writer *w, const expr_program *p, int k);

static void print_kid(writer *w, const expr_program *p, int k)
{
    if (w->pc_of) put(w, "v%d", w->pc_of[k]);
    else print_node(w, p, k);
}

/* fn(kids...), (a) op (b), and (c) ? (a) : (b) */
static void print_call(writer *w, const expr_program *p, const node *n, const char *fn)
{
    put(w, "%s(", fn);
    for (int i = 0; i < n->nkid; i++) {
        if (i) put(w, ", ");
        print_kid(w, p, n->kid[i]);
    }
    put(w, ")");
}
static void print_infix(writer *w, const expr_program *p, const node *n, const char *op)
{
    put(w, "(("); print_kid(w, p, n->kid[0]); put(w, ") %s (", op); print_kid(w, p, n->kid[1]); put(w, "))");
}
static void print_where(writer *w, const expr_program *p, const node *n)
{
    put(w, "(("); print_kid(w, p, n->kid[0]); put(w, ") ? (");
    print_kid(w, p, n->kid[1]); put(w, ") : ("); print_kid(w, p, n->kid[2]); put(w, "))");
}

/* A read of a capture: the capture's dtype as a literal (fixed when the mod was made): after
 * inlining, a read is one load, not a branch over every dtype at each of a kernel's unrolled reads. */
static void print_read(writer *w, const expr_program *p, int k)
{
    const node *n = &p->tree[k];
    put(w, "nsa_mod_read%c(caps, %d, %d, %d", n->type == T_FLOAT ? 'f' : 'i', n->cap, n->nkid, (int)p->cap[n->cap].tensor.dtype);
    for (int i = 0; i < 4; i++) {
        put(w, ", ");
        if (i < n->nkid) print_kid(w, p, n->kid[i]);
        else put(w, "0LL");
    }
    put(w, ")");
}

static void print_node(writer *w, const expr_program *p, int k)
{
    const node *n = &p->tree[k];
    const int fl = n->nkid > 0 && p->tree[n->kid[0]].type == T_FLOAT;
    static const char *const CMP_OP[] = {"<", "<=", ">", ">=", "==", "!="};
    static const char *const LOGIC_OP[] = {"&&", "||"};
    static const char *const BIT_OP[] = {"&", "|", "^"};
    if (w->narrow && w->narrow[k]) { /* an int in 32 bits: its exact value fits, so plain int arithmetic
                                         (where, ~, & | ^ print as in 64 bits, on 32-bit operands) */
        const char *fn32 = n->op == O_ABS ? "nsa_mod_iabs32" : n->op == O_MIN ? "nsa_mod_imin32" : n->op == O_MAX ? "nsa_mod_imax32"
                         : n->op == O_FLOORDIV ? "nsa_mod_floordiv32" : n->op == O_MOD ? "nsa_mod_mod32" : NULL;
        const char *op32 = n->op == O_ADD ? "+" : n->op == O_SUB ? "-" : n->op == O_MUL ? "*" : NULL;
        switch (n->op) {
        case O_INT: put(w, "((int)%" PRId64 "LL)", n->i); return;
        case O_VAR_B: put(w, "((int)b)"); return;
        case O_VAR_H: put(w, "((int)h)"); return;
        case O_VAR_Q: put(w, "((int)q_idx)"); return;
        case O_VAR_K: put(w, "((int)kv_idx)"); return;
        case O_READ: put(w, "((int)"); print_read(w, p, k); put(w, ")"); return;
        case O_NEG: put(w, "(-("); print_kid(w, p, n->kid[0]); put(w, "))"); return;
        default: break;
        }
        if (fn32) {
            print_call(w, p, n, fn32);
            return;
        }
        if (op32) {
            print_infix(w, p, n, op32);
            return;
        }
    }
    switch (n->op) {
    case O_INT:
        if (n->type == T_BOOL) put(w, "%d", n->i ? 1 : 0);
        else put(w, "(%" PRId64 "LL)", n->i);
        return;
    case O_FLOAT: {
        uint32_t bits;
        memcpy(&bits, &n->f, 4);
        put(w, "nsa_mod_fbits(0x%08xu)", (unsigned)bits); /* exact, inf and NaN included */
        return;
    }
    case O_VAR_B: put(w, "b"); return;
    case O_VAR_H: put(w, "h"); return;
    case O_VAR_Q: put(w, "q_idx"); return;
    case O_VAR_K: put(w, "kv_idx"); return;
    case O_VAR_SCORE: put(w, "score"); return;
    case O_READ: print_read(w, p, k); return;
    default: break;
    }
    const char *fn = NULL;
    switch (n->op) { /* functions of the kids */
    case O_TO_FLOAT: put(w, "((float)("); print_kid(w, p, n->kid[0]); put(w, "))"); return;
    case O_NEG:
        if (fl) { put(w, "(-("); print_kid(w, p, n->kid[0]); put(w, "))"); return; }
        put(w, "nsa_mod_sub(0LL, "); print_kid(w, p, n->kid[0]); put(w, ")");
        return;
    case O_NOT: put(w, "(!("); print_kid(w, p, n->kid[0]); put(w, "))"); return;
    case O_BNOT: put(w, "(~("); print_kid(w, p, n->kid[0]); put(w, "))"); return;
    case O_WHERE: print_where(w, p, n); return;
    case O_ABS: fn = fl ? "fabsf" : "nsa_mod_iabs"; break;
    case O_EXP: fn = "expf"; break;
    case O_LOG: fn = "logf"; break;
    case O_TANH: fn = "tanhf"; break;
    case O_SIGMOID: fn = "nsa_mod_sigmoid"; break;
    case O_SQRT: fn = "sqrtf"; break;
    case O_FLOOR: fn = "floorf"; break;
    case O_ADD: if (!fl) fn = "nsa_mod_add"; break;
    case O_SUB: if (!fl) fn = "nsa_mod_sub"; break;
    case O_MUL: if (!fl) fn = "nsa_mod_mul"; break;
    case O_FLOORDIV: if (!fl) fn = "nsa_mod_floordiv"; break;
    case O_MOD: fn = fl ? "nsa_mod_fmod" : "nsa_mod_mod"; break;
    case O_MIN: fn = fl ? "nsa_mod_fmin" : "nsa_mod_imin"; break;
    case O_MAX: fn = fl ? "nsa_mod_fmax" : "nsa_mod_imax"; break;
    default: break;
    }
    if (fn) {
        print_call(w, p, n, fn);
        return;
    }
    const char *op = n->op == O_ADD ? "+" : n->op == O_SUB ? "-" : n->op == O_MUL ? "*" : n->op == O_DIV ? "/" : NULL;
    if (n->op >= O_LT && n->op <= O_NE) op = CMP_OP[n->op - O_LT];
    if (n->op == O_AND || n->op == O_OR) op = LOGIC_OP[n->op - O_AND];
    if (n->op >= O_BAND && n->op <= O_BXOR) op = BIT_OP[n->op - O_BAND];
    if (n->op == O_FLOORDIV) { /* float floor division */
        put(w, "floorf(("); print_kid(w, p, n->kid[0]); put(w, ") / ("); print_kid(w, p, n->kid[1]); put(w, "))");
        return;
    }
    print_infix(w, p, n, op ? op : "?");
}

/* The 32-bit int nodes of p (idx32: see expr_to_c) as a malloc'd array indexed by tree node (a
 * node's kids come before it, so root + 1 entries), or NULL: none (no idx32, or no memory: every
 * int in 64 bits, the same values). */
static unsigned char *narrow_nodes(const expr_program *p, int idx32)
{
    if (!idx32) return NULL;
    irange *r = (irange *)calloc((size_t)p->root + 1, sizeof *r);
    unsigned char *done = (unsigned char *)calloc((size_t)p->root + 1, 1), *narrow = (unsigned char *)calloc((size_t)p->root + 1, 1);
    if (r && done && narrow) {
        ir_of(p, p->root, r, done);
        ir_mark(p, p->root, r, narrow);
    } else {
        free(narrow);
        narrow = NULL;
    }
    free(r), free(done);
    return narrow;
}

size_t expr_to_c(const expr_program *p, int idx32, char *buf, size_t size)
{
    unsigned char *narrow = narrow_nodes(p, idx32);
    writer w = {buf, size, 0, NULL, narrow};
    if (size) buf[0] = 0;
    print_node(&w, p, p->root);
    free(narrow);
    return w.len;
}

/* ---- reverse mode ---------------------------------------------------------------------------- */
size_t expr_scratch_bytes(const expr_program *p) { return (size_t)p->n * (sizeof(value) + sizeof(float)); }

float expr_grad(const expr_program *p, int64_t b, int64_t h, int64_t q_idx, int64_t kv_idx, float score, float g,
                float *dscore, float *const *grads, void *scratch)
{
    value *val = (value *)scratch; /* every instruction's result, by instruction */
    float *adj = (float *)(val + p->n);
    /* forward: the evaluator's arithmetic, each result kept */
    const expr_at at = {b, h, q_idx, kv_idx, score};
    for (int pc = 0; pc < p->n; pc++) {
        const insn *in = &p->code[pc];
        value opd[MAX_ARGS];
        for (int i = 0; i < in->nargs; i++) opd[i] = val[in->arg[i]];
        val[pc] = expr_apply(p, in, opd, &at);
        adj[pc] = 0.0f;
    }
    /* backward: adjoints of the float results, from the root down */
    float ds = 0.0f;
    adj[p->n - 1] = g;
    for (int pc = p->n - 1; pc >= 0; pc--) {
        const insn *in = &p->code[pc];
        const float a = adj[pc];
        if (a == 0.0f || in->type != T_FLOAT) continue; /* (bools and ints carry no gradient) */
        const int A = in->nargs > 0 ? in->arg[0] : 0, Bx = in->nargs > 1 ? in->arg[1] : 0;
        const float va = in->nargs > 0 ? val[A].f : 0.0f, vb = in->nargs > 1 ? val[Bx].f : 0.0f, v = val[pc].f;
        switch ((opcode)in->op) {
        case O_VAR_SCORE: ds += a; break;
        case O_READ: {
            const expr_capture *c = &p->cap[in->cap];
            if (!grads || !grads[in->cap]) break;
            if (c->tensor.dtype != NSA_DTYPE_F32 && c->tensor.dtype != NSA_DTYPE_F16 && c->tensor.dtype != NSA_DTYPE_BF16) break;
            int64_t lin = 0;
            for (int d = 0; d < in->nargs; d++) {
                int64_t i = val[in->arg[d]].i;
                i = i < 0 ? 0 : i >= c->tensor.shape[d] ? c->tensor.shape[d] - 1 : i;
                lin = lin * c->tensor.shape[d] + i;
            }
            grads[in->cap][lin] += a;
            break;
        }
        case O_ADD: adj[A] += a, adj[Bx] += a; break;
        case O_SUB: adj[A] += a, adj[Bx] -= a; break;
        case O_MUL: adj[A] += a * vb, adj[Bx] += a * va; break;
        case O_DIV: adj[A] += a / vb, adj[Bx] -= a * va / (vb * vb); break;
        case O_NEG: adj[A] -= a; break;
        case O_MOD: adj[A] += a, adj[Bx] -= a * floorf(va / vb); break;
        case O_MIN: adj[(va < vb || va != va) ? A : Bx] += a; break;
        case O_MAX: adj[(va > vb || va != va) ? A : Bx] += a; break;
        case O_ABS: adj[A] += va > 0.0f ? a : va < 0.0f ? -a : 0.0f; break;
        case O_EXP: adj[A] += a * v; break;
        case O_LOG: adj[A] += a / va; break;
        case O_TANH: adj[A] += a * (1.0f - v * v); break;
        case O_SIGMOID: adj[A] += a * v * (1.0f - v); break;
        case O_SQRT: adj[A] += a * 0.5f / v; break;
        case O_WHERE: adj[val[in->arg[0]].i ? in->arg[1] : in->arg[2]] += a; break;
        default: break; /* floor, floor division, conversions of ints, comparisons: no gradient */
        }
    }
    if (dscore) *dscore = ds;
    return val[p->n - 1].f;
}

/* The reverse mode above as C: the forward as one statement an instruction (v<pc>), then the
 * adjoints (a<pc>, float results only) from the root down, each pushed only when nonzero as
 * expr_grad does, so that a zero adjoint never meets an infinite partial derivative. */
size_t expr_grad_to_c(const expr_program *p, int idx32, char *buf, size_t size)
{
    int *pc_of = (int *)calloc((size_t)MAX_NODES, sizeof(int));
    unsigned char *narrow = narrow_nodes(p, idx32);
    writer w = {buf, size, 0, pc_of, narrow};
    if (size) buf[0] = 0;
    if (!pc_of) {
        free(narrow);
        return 0;
    }
    for (int pc = 0; pc < p->n; pc++) pc_of[p->code[pc].node] = pc;
    put(&w, "NSA_MOD_FN float nsa_mod_score_grad(const nsa_mod_caps *caps, const nsa_mod_sink *sink, long long b, long long h,\n"
            "                                    long long q_idx, long long kv_idx, float score, float g, float *dscore)\n{\n");
    for (int pc = 0; pc < p->n; pc++) {
        const int node = p->code[pc].node, fl = p->tree[node].type == T_FLOAT;
        put(&w, "    const %s v%d = ", fl ? "float" : narrow && narrow[node] ? "int" : "long long", pc);
        print_node(&w, p, p->code[pc].node);
        put(&w, ";\n");
    }
    for (int pc = 0; pc < p->n; pc++)
        if (p->tree[p->code[pc].node].type == T_FLOAT) put(&w, "    float a%d = 0.0f;\n", pc);
    put(&w, "    float ds = 0.0f;\n    a%d = g;\n", p->n - 1);
    for (int pc = p->n - 1; pc >= 0; pc--) {
        const insn *in = &p->code[pc];
        if (p->tree[in->node].type != T_FLOAT) continue;
        const int A = in->arg[0], B = in->arg[1];
        put(&w, "    if (a%d != 0.0f) { ", pc);
        switch ((opcode)in->op) {
        case O_VAR_SCORE: put(&w, "ds += a%d;", pc); break;
        case O_READ:
            put(&w, "nsa_mod_grad(sink, %d, nsa_mod_lin(caps, %d, %d", in->cap, in->cap, in->nargs);
            for (int i = 0; i < 4; i++) i < in->nargs ? put(&w, ", v%d", in->arg[i]) : put(&w, ", 0LL");
            put(&w, "), a%d);", pc);
            break;
        case O_ADD: put(&w, "a%d += a%d; a%d += a%d;", A, pc, B, pc); break;
        case O_SUB: put(&w, "a%d += a%d; a%d -= a%d;", A, pc, B, pc); break;
        case O_MUL: put(&w, "a%d += a%d * v%d; a%d += a%d * v%d;", A, pc, B, B, pc, A); break;
        case O_DIV: put(&w, "a%d += a%d / v%d; a%d -= a%d * v%d / (v%d * v%d);", A, pc, B, B, pc, A, B, B); break;
        case O_NEG: put(&w, "a%d -= a%d;", A, pc); break;
        case O_MOD: put(&w, "a%d += a%d; a%d -= a%d * floorf(v%d / v%d);", A, pc, B, pc, A, B); break;
        case O_MIN: put(&w, "if (v%d < v%d || v%d != v%d) a%d += a%d; else a%d += a%d;", A, B, A, A, A, pc, B, pc); break;
        case O_MAX: put(&w, "if (v%d > v%d || v%d != v%d) a%d += a%d; else a%d += a%d;", A, B, A, A, A, pc, B, pc); break;
        case O_ABS: put(&w, "a%d += v%d > 0.0f ? a%d : v%d < 0.0f ? -a%d : 0.0f;", A, A, pc, A, pc); break;
        case O_EXP: put(&w, "a%d += a%d * v%d;", A, pc, pc); break;
        case O_LOG: put(&w, "a%d += a%d / v%d;", A, pc, A); break;
        case O_TANH: put(&w, "a%d += a%d * (1.0f - v%d * v%d);", A, pc, pc, pc); break;
        case O_SIGMOID: put(&w, "a%d += a%d * v%d * (1.0f - v%d);", A, pc, pc, pc); break;
        case O_SQRT: put(&w, "a%d += a%d * 0.5f / v%d;", A, pc, pc); break;
        case O_WHERE: put(&w, "if (v%d) a%d += a%d; else a%d += a%d;", A, B, pc, in->arg[2], pc); break;
        default: break; /* floor, floor division, conversions of ints, constants: no gradient */
        }
        put(&w, " }\n");
    }
    put(&w, "    *dscore = ds;\n    return v%d;\n}\n", p->n - 1);
    free(pc_of), free(narrow);
    return w.len;
}

/* ---- mods that nsa_attention's options express ------------------------------------------------ */
/* Recognised by the shape of the tree, as FlexAttention's examples (and nsa.flex's tracer) write
 * them; anything else is left to the block-sparse engine. */

static int int_const(const expr_program *p, int k, int64_t *v)
{
    const node *n = &p->tree[k];
    if (n->op == O_INT && n->type == T_INT) {
        *v = n->i;
        return 1;
    }
    if (n->op == O_NEG && int_const(p, n->kid[0], v) && *v != INT64_MIN) {
        *v = -*v;
        return 1;
    }
    return 0;
}

static int float_const(const expr_program *p, int k, float *v)
{
    const node *n = &p->tree[k];
    int64_t i;
    if (n->op == O_FLOAT) {
        *v = n->f;
        return 1;
    }
    if (n->op == O_TO_FLOAT && int_const(p, n->kid[0], &i) && i > -(1 << 24) && i < (1 << 24)) {
        *v = (float)i; /* (exact) */
        return 1;
    }
    if (n->op == O_NEG && float_const(p, n->kid[0], v)) {
        *v = -*v;
        return 1;
    }
    return 0;
}

static int is_op(const expr_program *p, int k, opcode op) { return p->tree[k].op == op; }

/* q_idx - kv_idx (sign 1) or kv_idx - q_idx (sign -1); 0 otherwise */
static int diff_sign(const expr_program *p, int k)
{
    const node *n = &p->tree[k];
    if (n->op != O_SUB) return 0;
    if (is_op(p, n->kid[0], O_VAR_Q) && is_op(p, n->kid[1], O_VAR_K)) return 1;
    if (is_op(p, n->kid[0], O_VAR_K) && is_op(p, n->kid[1], O_VAR_Q)) return -1;
    return 0;
}

/* One comparison of the conjunction into *a; 0 when it is not one of the forms. */
static int attention_atom(const expr_program *p, int k, expr_attention *a)
{
    const node *n = &p->tree[k];
    if (n->op == O_INT && n->type == T_BOOL) return n->i != 0; /* true: no condition */
    if (n->op < O_LT || n->op > O_EQ || n->nkid != 2) return 0;
    int x = n->kid[0], y = n->kid[1];
    opcode op = n->op;
    if (op == O_EQ) { /* doc[q_idx] == doc[kv_idx] (either order): one rank-1 int32 tensor */
        const node *l = &p->tree[x], *r = &p->tree[y];
        if (l->op != O_READ || r->op != O_READ || l->cap != r->cap || l->nkid != 1 || r->nkid != 1) return 0;
        if (p->cap[l->cap].tensor.dtype != NSA_DTYPE_I32) return 0;
        const int qk = is_op(p, l->kid[0], O_VAR_Q) && is_op(p, r->kid[0], O_VAR_K);
        const int kq = is_op(p, l->kid[0], O_VAR_K) && is_op(p, r->kid[0], O_VAR_Q);
        if (!qk && !kq) return 0;
        if (a->doc >= 0 && a->doc != l->cap) return 0;
        a->doc = l->cap;
        return 1;
    }
    /* the variable side on the left: c OP e becomes e OP' c */
    int64_t c;
    if (int_const(p, x, &c) || (is_op(p, y, O_VAR_Q) && is_op(p, x, O_VAR_K))) {
        const int t = x;
        x = y, y = t;
        op = op == O_LT ? O_GT : op == O_LE ? O_GE : op == O_GT ? O_LT : O_LE;
    }
    if ((is_op(p, x, O_VAR_Q) && is_op(p, y, O_VAR_K) && op == O_GE) || /* q_idx >= kv_idx */
        (is_op(p, x, O_VAR_K) && is_op(p, y, O_VAR_Q) && op == O_LE)) {  /* kv_idx <= q_idx */
        a->causal = 1;
        return 1;
    }
    if (!int_const(p, y, &c)) return 0;
    int64_t w = -2; /* the bound's window, inclusive */
    const int s = diff_sign(p, x);
    if (s == 1 && op == O_GE && c == 0) { /* q_idx - kv_idx >= 0 */
        a->causal = 1;
        return 1;
    }
    if (s == 1 && (op == O_LT || op == O_LE)) { /* q_idx - kv_idx < c: keys down to q_idx - (c - 1) */
        w = op == O_LT ? c - 1 : c;
        if (w < 0) return 0;
        a->window_left = a->window_left < 0 || w < a->window_left ? w : a->window_left;
        return 1;
    }
    if (s == -1 && (op == O_GT || op == O_GE)) { /* kv_idx - q_idx > -c: the same bound */
        if (c == INT64_MIN) return 0;
        w = op == O_GT ? -c - 1 : -c;
        if (w < 0) return 0;
        a->window_left = a->window_left < 0 || w < a->window_left ? w : a->window_left;
        return 1;
    }
    if (is_op(p, x, O_ABS) && diff_sign(p, p->tree[x].kid[0]) != 0 && (op == O_LT || op == O_LE)) { /* |q - k| < c */
        w = op == O_LT ? c - 1 : c;
        if (w < 0) return 0;
        a->window_left = a->window_left < 0 || w < a->window_left ? w : a->window_left;
        a->window_right = a->window_right < 0 || w < a->window_right ? w : a->window_right;
        return 1;
    }
    return 0;
}

/* Every operand of a tree of logical ands (&&, or & on bools). */
static int attention_conj(const expr_program *p, int k, expr_attention *a)
{
    const node *n = &p->tree[k];
    if ((n->op == O_AND || n->op == O_BAND) && n->type == T_BOOL)
        return attention_conj(p, n->kid[0], a) && attention_conj(p, n->kid[1], a);
    return attention_atom(p, k, a);
}

/* kv_idx < c, c > kv_idx, kv_idx <= c - 1 or c - 1 >= kv_idx: *c, the keys every row sees. */
static int prefix_atom(const expr_program *p, int k, int64_t *c)
{
    const node *n = &p->tree[k];
    if (n->nkid != 2 || (n->op != O_LT && n->op != O_LE && n->op != O_GT && n->op != O_GE)) return 0;
    int64_t v;
    if (is_op(p, n->kid[0], O_VAR_K) && int_const(p, n->kid[1], &v) && (n->op == O_LT || n->op == O_LE)) {
        if (n->op == O_LE && v == INT64_MAX) return 0;
        *c = n->op == O_LT ? v : v + 1;
        return 1;
    }
    if (is_op(p, n->kid[1], O_VAR_K) && int_const(p, n->kid[0], &v) && (n->op == O_GT || n->op == O_GE)) {
        if (n->op == O_GE && v == INT64_MAX) return 0;
        *c = n->op == O_GT ? v : v + 1;
        return 1;
    }
    return 0;
}

/* A prefix-LM mask: (kv_idx < c) || (q_idx >= kv_idx), | of bools too, either order. */
static int attention_prefix(const expr_program *p, int k, expr_attention *a)
{
    const node *n = &p->tree[k];
    if (!(n->op == O_OR || (n->op == O_BOR && n->type == T_BOOL))) return 0;
    for (int side = 0; side < 2; side++) {
        int64_t c;
        expr_attention causal = {0, -1, -1, -1, 0.0f, 0};
        if (prefix_atom(p, n->kid[side], &c) && c >= 1 && attention_atom(p, n->kid[1 - side], &causal) && causal.causal &&
            causal.window_left < 0 && causal.window_right < 0 && causal.doc < 0) {
            a->causal = 1, a->prefix = c;
            return 1;
        }
    }
    return 0;
}

int expr_as_attention(const expr_program *mask, const expr_program *score, expr_attention *out)
{
    expr_attention a = {0, -1, -1, -1, 0.0f, 0};
    if (mask && (mask->kind != EXPR_MASK || !(attention_prefix(mask, mask->root, &a) || attention_conj(mask, mask->root, &a))))
        return 0;
    if (score) {
        if (score->kind != EXPR_SCORE) return 0;
        const node *n = &score->tree[score->root];
        if (n->op != O_VAR_SCORE) { /* C * tanh(score / C), either factor first */
            if (n->op != O_MUL) return 0;
            int t = n->kid[1], cf = n->kid[0];
            if (is_op(score, n->kid[0], O_TANH)) t = n->kid[0], cf = n->kid[1];
            float c1, c2;
            if (!is_op(score, t, O_TANH) || !float_const(score, cf, &c1)) return 0;
            const node *d = &score->tree[score->tree[t].kid[0]];
            if (d->op != O_DIV || !is_op(score, d->kid[0], O_VAR_SCORE) || !float_const(score, d->kid[1], &c2)) return 0;
            if (!(c1 == c2 && c1 > 0.0f && c1 <= 3.0e38f)) return 0;
            a.softcap = c1;
        }
    }
    *out = a;
    return 1;
}
