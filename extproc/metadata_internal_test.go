package extproc

import (
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/structpb"
)

// TestMetadataWireFieldNumbers: the field numbers the metadata writer uses are the generated
// messages' own.
func TestMetadataWireFieldNumbers(t *testing.T) {
	field := func(m protoreflect.MessageDescriptor, name string) protowire.Number {
		f := m.Fields().ByName(protoreflect.Name(name))
		if f == nil {
			t.Fatalf("%s has no field %s", m.FullName(), name)
		}
		return f.Number()
	}
	resp := (&extprocv3.ProcessingResponse{}).ProtoReflect().Descriptor()
	st := (&structpb.Struct{}).ProtoReflect().Descriptor()
	entry := st.Fields().ByName("fields").Message()
	val := (&structpb.Value{}).ProtoReflect().Descriptor()
	for _, c := range []struct {
		got, want protowire.Number
		name      string
	}{
		{fieldResponseDynamicMetadata, field(resp, "dynamic_metadata"), "ProcessingResponse.dynamic_metadata"},
		{fieldStructFields, field(st, "fields"), "Struct.fields"},
		{fieldEntryKey, field(entry, "key"), "FieldsEntry.key"},
		{fieldEntryValue, field(entry, "value"), "FieldsEntry.value"},
		{fieldValueNumber, field(val, "number_value"), "Value.number_value"},
		{fieldValueString, field(val, "string_value"), "Value.string_value"},
		{fieldValueBool, field(val, "bool_value"), "Value.bool_value"},
		{fieldValueStruct, field(val, "struct_value"), "Value.struct_value"},
	} {
		if c.got != c.want {
			t.Errorf("%s is field %d, the writer uses %d", c.name, c.want, c.got)
		}
	}
}
