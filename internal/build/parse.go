package build

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"strings"
)

// Instruction is one Dockerfile instruction.
type Instruction struct {
	Line  int
	Cmd   string            // upper case: FROM, RUN, COPY, ...
	Flags map[string]string // --name=value before the arguments
	Args  string            // the rest, as written (continuations joined)
	Exec  []string          // the JSON form's arguments, when Args is one
}

// String is the instruction as the build shows it.
func (in Instruction) String() string {
	s := in.Cmd
	for k, v := range in.Flags {
		s += " --" + k + "=" + v
	}
	return s + " " + in.Args
}

// supported are the instructions cage builds (the subset people use).
var supported = map[string]bool{"FROM": true, "RUN": true, "COPY": true, "ADD": true, "ENV": true, "WORKDIR": true,
	"USER": true, "ARG": true, "LABEL": true, "CMD": true, "ENTRYPOINT": true}

// Parse reads a Dockerfile: comments, line continuations with a trailing
// backslash, instruction names in any case, --flag=value options, and the
// JSON (exec) form. An instruction cage does not build is an error naming
// its line.
func Parse(r io.Reader) ([]Instruction, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 1<<20)
	var out []Instruction
	var cur strings.Builder
	start, line := 0, 0
	flush := func() error {
		text := strings.TrimSpace(cur.String())
		cur.Reset()
		if text == "" {
			return nil
		}
		in, err := parseLine(text)
		if err != nil {
			return fmt.Errorf("Dockerfile line %d: %w", start, err)
		}
		in.Line = start
		out = append(out, in)
		return nil
	}
	for sc.Scan() {
		line++
		raw := sc.Text()
		trimmed := strings.TrimSpace(raw)
		if strings.HasPrefix(trimmed, "#") {
			continue // a comment, also between continued lines
		}
		if cur.Len() == 0 {
			if trimmed == "" {
				continue
			}
			start = line
		}
		if strings.HasSuffix(trimmed, "\\") {
			cur.WriteString(strings.TrimSuffix(trimmed, "\\"))
			cur.WriteString(" ")
			continue
		}
		cur.WriteString(trimmed)
		if err := flush(); err != nil {
			return nil, err
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if err := flush(); err != nil {
		return nil, err
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("the Dockerfile has no instructions")
	}
	first := 0
	for first < len(out) && out[first].Cmd == "ARG" {
		first++
	}
	if first == len(out) || out[first].Cmd != "FROM" {
		return nil, fmt.Errorf("Dockerfile line %d: the first instruction must be FROM", out[min(first, len(out)-1)].Line)
	}
	for _, in := range out[first+1:] {
		if in.Cmd == "FROM" {
			return nil, fmt.Errorf("Dockerfile line %d: multi-stage builds (a second FROM) are not supported", in.Line)
		}
	}
	return out, nil
}

func parseLine(text string) (Instruction, error) {
	word, rest, _ := strings.Cut(text, " ")
	in := Instruction{Cmd: strings.ToUpper(word), Flags: map[string]string{}}
	if !supported[in.Cmd] {
		return in, fmt.Errorf("%s is not supported (cage builds FROM, RUN, COPY, ADD, ENV, WORKDIR, USER, ARG, LABEL, CMD, ENTRYPOINT)", in.Cmd)
	}
	rest = strings.TrimSpace(rest)
	for strings.HasPrefix(rest, "--") {
		var flag string
		flag, rest, _ = strings.Cut(rest, " ")
		k, v, _ := strings.Cut(strings.TrimPrefix(flag, "--"), "=")
		in.Flags[k] = v
		rest = strings.TrimSpace(rest)
	}
	in.Args = rest
	if strings.HasPrefix(rest, "[") {
		var exec []string
		if err := json.Unmarshal([]byte(rest), &exec); err == nil {
			in.Exec = exec
		}
	}
	if in.Args == "" {
		return in, fmt.Errorf("%s needs arguments", in.Cmd)
	}
	return in, nil
}

// words splits s on white space, honouring double and single quotes (ENV,
// LABEL and ARG values).
func words(s string) ([]string, error) {
	var out []string
	var cur strings.Builder
	var quote rune
	inWord := false
	for _, r := range s {
		switch {
		case quote != 0:
			if r == quote {
				quote = 0
			} else {
				cur.WriteRune(r)
			}
		case r == '"' || r == '\'':
			quote, inWord = r, true
		case r == ' ' || r == '\t':
			if inWord {
				out = append(out, cur.String())
				cur.Reset()
				inWord = false
			}
		default:
			cur.WriteRune(r)
			inWord = true
		}
	}
	if quote != 0 {
		return nil, fmt.Errorf("unterminated quote in %q", s)
	}
	if inWord {
		out = append(out, cur.String())
	}
	return out, nil
}

// pairs reads KEY=VALUE pairs (ENV, LABEL), or the old "KEY VALUE" form.
func pairs(s string) ([][2]string, error) {
	ws, err := words(s)
	if err != nil {
		return nil, err
	}
	if len(ws) >= 1 && !strings.Contains(ws[0], "=") {
		k, v, _ := strings.Cut(s, " ")
		return [][2]string{{k, strings.TrimSpace(v)}}, nil
	}
	var out [][2]string
	for _, w := range ws {
		k, v, ok := strings.Cut(w, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("%q: want KEY=VALUE", w)
		}
		out = append(out, [2]string{k, v})
	}
	return out, nil
}

// maxExpanded bounds an instruction's arguments once expanded, as Parse
// bounds them written: a variable may name itself (ENV A=$A$A), and each
// such line doubled it, so that 40 lines of a Dockerfile asked the host
// for a terabyte.
const maxExpanded = 1 << 20

// expand substitutes $NAME and ${NAME} from vars; past maxExpanded bytes it
// stops with an error.
func expand(s string, vars map[string]string) (string, error) {
	var b strings.Builder
	tooLong := func() (string, error) {
		return "", fmt.Errorf("the arguments are past %d KiB once their variables are expanded", maxExpanded>>10)
	}
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+1 < len(s) && s[i+1] == '$' {
			b.WriteByte('$')
			i++
			continue
		}
		if s[i] != '$' || i+1 == len(s) {
			b.WriteByte(s[i])
			continue
		}
		j := i + 1
		var name string
		if s[j] == '{' {
			end := strings.IndexByte(s[j:], '}')
			if end < 0 {
				b.WriteByte(s[i])
				continue
			}
			name = s[j+1 : j+end]
			i = j + end
		} else {
			k := j
			for k < len(s) && (s[k] == '_' || s[k] >= 'a' && s[k] <= 'z' || s[k] >= 'A' && s[k] <= 'Z' || s[k] >= '0' && s[k] <= '9') {
				k++
			}
			if k == j {
				b.WriteByte(s[i])
				continue
			}
			name = s[j:k]
			i = k - 1
		}
		if b.Len()+len(vars[name]) > maxExpanded {
			return tooLong()
		}
		b.WriteString(vars[name])
	}
	if b.Len() > maxExpanded {
		return tooLong()
	}
	return b.String(), nil
}
