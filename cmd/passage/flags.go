package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
)

// newFlags is a command's flag set. Parse errors go to stderr; help is parseFlags's.
func newFlags(name string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {} // parseFlags prints the help: on stdout for -h, a pointer to it after a bad flag
	return fs
}

// parseFlags parses a command's arguments, flags before, between or after the
// positional ones (everything after "--" is positional). ok is false when the command
// is to return code at once: 0 after printing its help for -h/--help, 2 after a bad flag.
func parseFlags(fs *flag.FlagSet, args []string, stdout io.Writer) (pos []string, code int, ok bool) {
	for {
		err := fs.Parse(args)
		if errors.Is(err, flag.ErrHelp) {
			writeHelp(stdout, fs)
			return nil, 0, false
		}
		if err != nil {
			fmt.Fprintf(fs.Output(), "passage %s: see passage help %s\n", fs.Name(), fs.Name())
			return nil, 2, false
		}
		rest := fs.Args()
		if consumed := len(args) - len(rest); consumed > 0 && args[consumed-1] == "--" {
			return append(pos, rest...), 0, true
		}
		if len(rest) == 0 {
			return pos, 0, true
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}

// parseNoArgs is parseFlags for a command that takes flags only: an argument is a usage
// error (exit 2).
func parseNoArgs(fs *flag.FlagSet, args []string, stdout io.Writer) (code int, ok bool) {
	pos, code, ok := parseFlags(fs, args, stdout)
	if ok && len(pos) > 0 {
		fmt.Fprintf(fs.Output(), "passage %s: unexpected argument %q\n", fs.Name(), pos[0])
		return 2, false
	}
	return code, ok
}

// writeHelp is a command's help: its synopsis, what it does, more when it has more to
// say, and its flags.
func writeHelp(w io.Writer, fs *flag.FlagSet) {
	c := commands()[fs.Name()]
	for i, l := range strings.Split(c.synopsis, "\n") {
		prefix := "usage: "
		if i > 0 {
			prefix = "       "
		}
		fmt.Fprintf(w, "%spassage %s %s\n", prefix, fs.Name(), l)
	}
	fmt.Fprintf(w, "\n%s.\n", upperFirst(c.summary))
	if c.detail != "" {
		fmt.Fprintf(w, "\n%s\n", c.detail)
	}
	fmt.Fprintln(w, "\nflags:")
	out := fs.Output()
	fs.SetOutput(w)
	fs.PrintDefaults()
	fs.SetOutput(out)
}

func upperFirst(s string) string {
	if s == "" {
		return s
	}
	return strings.ToUpper(s[:1]) + s[1:]
}

// deprecatedFlag keeps an old flag name working for one release: it sets what the new
// name sets and says once on stderr that the name goes.
func deprecatedFlag(fs *flag.FlagSet, old, now string, set func(string) error) {
	said := false
	fs.Func(old, "deprecated: use "+dashes(now)+" (this name goes in the next release)", func(v string) error {
		if !said {
			fmt.Fprintf(fs.Output(), "passage %s: %s is deprecated, use %s\n", fs.Name(), dashes(old), dashes(now))
			said = true
		}
		return set(v)
	})
}

// deprecatedAlias is deprecatedFlag for an old name of another flag of fs.
func deprecatedAlias(fs *flag.FlagSet, old, now string) {
	deprecatedFlag(fs, old, now, func(v string) error { return fs.Set(now, v) })
}

// deprecatedBoolAlias is deprecatedAlias for a boolean flag: the old name too stands
// alone (--units, not --units=true).
func deprecatedBoolAlias(fs *flag.FlagSet, old, now string) {
	fs.Var(&boolAlias{fs: fs, old: old, now: now}, old, "deprecated: use "+dashes(now)+" (this name goes in the next release)")
}

type boolAlias struct {
	fs       *flag.FlagSet
	old, now string
	said     bool
}

func (b *boolAlias) IsBoolFlag() bool { return true }
func (b *boolAlias) String() string   { return "" }
func (b *boolAlias) Set(v string) error {
	if !b.said {
		fmt.Fprintf(b.fs.Output(), "passage %s: %s is deprecated, use %s\n", b.fs.Name(), dashes(b.old), dashes(b.now))
		b.said = true
	}
	return b.fs.Set(b.now, v)
}

// dashes writes a flag as the help does: -o, --pub.
func dashes(name string) string {
	if len(name) == 1 {
		return "-" + name
	}
	if strings.HasPrefix(name, "-") || strings.Contains(name, " ") {
		return name
	}
	return "--" + name
}
