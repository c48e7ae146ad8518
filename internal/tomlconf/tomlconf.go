// Package tomlconf decodes the project's TOML files (the daemon's and
// the shim's configuration, environment plans) strictly: a key the file
// has and the target does not is an error that names it, with its line,
// since a misspelt setting silently left at its default is worse than a
// daemon that does not start.
package tomlconf

import (
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/pelletier/go-toml/v2"
)

// Decode decodes the TOML document in r into v, rejecting unknown keys.
func Decode(r io.Reader, v any) error {
	err := toml.NewDecoder(r).DisallowUnknownFields().Decode(v)
	var sme *toml.StrictMissingError
	if !errors.As(err, &sme) {
		return err
	}
	keys := make([]string, 0, len(sme.Errors))
	for i := range sme.Errors {
		row, _ := sme.Errors[i].Position()
		keys = append(keys, fmt.Sprintf("%q (line %d)", strings.Join(sme.Errors[i].Key(), "."), row))
	}
	noun := "field"
	if len(keys) > 1 {
		noun = "fields"
	}
	return fmt.Errorf("unknown %s %s", noun, strings.Join(keys, ", "))
}
